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


def test_metal_without_its_runtime_library_says_which_file(tmp_path):
    """Runtime-only TVM on a Mac loads Metal from libtvm_runtime_metal.dylib; a TVM build
    without it (here: Linux's) is one line naming the file, not "no METAL device"."""
    import types

    registered: set[str] = set()
    fake_tvm = types.SimpleNamespace(
        __file__=str(tmp_path / "tvm" / "__init__.py"),
        get_global_func=lambda name, allow_missing=False: name if name in registered else None,
    )
    load = device_kind("metal").load_driver
    with pytest.raises(ArtifactError, match="libtvm_runtime_metal.dylib is not in .*docs/metal.md"):
        load(fake_tvm, "metal (macos-arm64)")
    (tmp_path / "tvm" / "lib").mkdir(parents=True)
    (tmp_path / "tvm" / "lib" / "libtvm_runtime_metal.dylib").write_bytes(b"not a library")
    with pytest.raises(ArtifactError, match="cannot load TVM's Metal runtime"):
        load(fake_tvm, "metal (macos-arm64)")
    registered.add("device_api.metal")  # already there (TVM loaded it itself): nothing to do
    load(fake_tvm, "metal (macos-arm64)")
