"""The runtime's per-device-kind table (runtime/devices.py): no TVM device needed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tallow.runtime.devices import DEVICE_KINDS, available_ram, device_kind
from tallow.runtime.errors import ArtifactError

RUNTIME = Path(__file__).resolve().parent.parent / "runtime"


def test_one_entry_per_kind_with_the_old_defaults():
    assert set(DEVICE_KINDS) == {"cpu", "cuda", "metal"}
    cpu, cuda, metal = (device_kind(k) for k in ("cpu", "cuda", "metal"))
    assert cpu.default_memory_fraction == 0.25 and cuda.default_memory_fraction == 0.9
    assert metal.default_memory_fraction == 0.9
    assert cpu.sets_cpu_threads and not cuda.sets_cpu_threads and not metal.sets_cpu_threads
    assert cpu.shares_host_memory and cpu.single_sequence_decode
    assert not cuda.shares_host_memory and not metal.single_sequence_decode
    assert cuda.batch_bound_detail == "cuda_graph" and cpu.batch_bound_detail is None
    assert cuda.load_driver is not None and not cpu.probe
    assert cpu.memory_bytes is available_ram


def test_unknown_kind_is_an_artifact_error():
    with pytest.raises(ArtifactError, match="unknown device kind 'tpu'"):
        device_kind("tpu")


def test_runtime_imports_no_compiler():
    """Runtime code runs with the TVM runtime alone: no tvm.relax, tvm.tir or tallow.compiler."""
    banned = ("tvm.relax", "tvm.tir", "tvm.te", "tallow.compiler", "tallow.model_defs")
    for path in RUNTIME.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            else:
                continue
            for name in names:
                assert not name.startswith(banned), f"{path.name} imports {name}"
                assert not name.startswith(("..compiler", "..model_defs", "..schedules")), (
                    f"{path.name} imports {name}"
                )
