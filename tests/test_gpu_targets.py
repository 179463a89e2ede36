"""CUDA and Metal artifacts built on this GPU-less Linux machine (compile-only checks).

The heavy compiles are `slow`; the fast tests cover target resolution and the CLI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tallow.compiler.macho_link import find_ld64
from tallow.compiler.target import resolve_target
from tallow.runtime.errors import TargetError
from tallow.runtime.manifest import Manifest

ROOT = Path(__file__).resolve().parents[1]
MACHO_ARM64 = bytes.fromhex("cffaedfe0c000001")  # MH_MAGIC_64, CPU_TYPE_ARM64

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


# --- fast: target resolution -------------------------------------------------------------
def test_cuda_target_spec():
    spec = resolve_target("cuda", "f16", [90, 80, 90])
    assert spec.tvm_target["arch"] == "sm_80"  # scheduled for the lowest requested arch
    assert spec.details["archs"] == ["sm_80", "sm_90"]
    assert spec.host == {"kind": "llvm"}
    assert spec.library_name == "lib/cuda-sm_80-sm_90.so" and spec.suffix == "cuda-sm_80-sm_90"
    assert str(spec.tvm().kind.name) == "cuda"


def test_metal_target_spec():
    spec = resolve_target("metal", "f16")
    assert spec.host == {"kind": "llvm", "mtriple": "arm64-apple-macos"}
    ext = ".dylib" if find_ld64() else ".tar"  # linked here by ld64.lld, else on the Mac
    assert spec.library_name == f"lib/metal-arm64{ext}"


@pytest.mark.parametrize(
    ("kind", "dtype", "sms", "message"),
    [
        ("cuda", "f16", [75], "--sm 75 is not supported"),
        ("cuda", "f16", [91], "choose from 80, 86, 89, 90, 100, 120"),
        ("cuda", "bf16", [70], "not supported"),
        ("metal", "bf16", None, "bf16 is not supported on metal"),
        ("cpu", "f32", [90], "--sm applies to --target cuda only"),
        ("rocm", "f16", None, "supported: cpu, cuda, metal"),
    ],
)
def test_target_errors(kind, dtype, sms, message):
    with pytest.raises(TargetError, match=message):
        resolve_target(kind, dtype, sms)


def test_cli_accepts_gpu_targets():
    from tallow.cli.main import build_parser

    args = build_parser().parse_args(
        ["compile", "--model", "x", "--target", "cuda", "--sm", "80", "--sm", "90"]
    )
    assert args.target == ["cuda"] and args.sms == [80, 90]


# --- slow: real compiles --------------------------------------------------------------------
def _compile(model_dir, out, target, sms=(), dtype="f16") -> Path:
    from tallow.compiler.pipeline import CompileOptions, compile_model

    # Without the static-row batch decodes (each costs compile time; test_gpu_schedules.py
    # and test_decode_padding.py check them).
    opts = CompileOptions(
        model=str(model_dir),
        target=target,
        sms=list(sms) or None,
        dtype=dtype,
        output=out,
        decode_buckets=(),
    )
    opts.quiet = True
    return compile_model(opts)


def _cuobjdump() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for base in list(spec.submodule_search_locations if spec else []):
        for cand in Path(base).glob("cu*/bin/cuobjdump"):
            return str(cand)
    return shutil.which("cuobjdump")


def _check_cuda_artifact(folder: Path, sms: list[int], tmp_path: Path) -> None:
    from tallow.compiler.cuda_build import fatbin_entries

    m = Manifest.read(folder)
    (lib,) = m.libraries
    assert (
        lib.device == "cuda"
        and lib.file == "lib/cuda-" + "-".join(f"sm_{sm}" for sm in sms) + ".so"
    )
    assert lib.cuda_archs == [f"sm_{sm}" for sm in sms]
    details = lib.details
    assert details["archs"] == [f"sm_{sm}" for sm in sms]
    assert details["nvcc"] and details["nvcc"] != "missing"
    assert details["schedules"]["rules"]["Matmul"] >= 1
    assert details["schedules"]["rules"]["prescheduled"] >= 1  # the KV cache kernels
    # TVM's racing merge kernel replaced by tallow's (schedules/gpu/merge_state.py)
    assert details["schedules"]["replaced_tvm_kernels"] == ["tir_attention_merge_state"]
    assert details["cuda_graph"]["max_batch_size"] == 64
    assert details["cuda_graph"]["captured_functions"] == ["batch_decode", "decode"]
    # Tiny widths (64) are below dlight's tensor-core threshold: recorded, never silent.
    tc = details["schedules"]["tensor_core"]
    assert tc["target_has_tensor_cores"] and not tc["tensorized_kernels"]
    assert all("<= 64" in k["reason"] for k in tc["matmul_kernels_without_tensor_cores"])
    entries = fatbin_entries(folder / lib.file)
    assert sorted(entries) == [("sass", sm) for sm in sms]  # SASS only, exactly these archs
    tool = _cuobjdump()
    if tool:  # an independent reading: extract the fatbin, list its ELF images
        data = (folder / lib.file).read_bytes()
        start = data.find(bytes.fromhex("50ed55ba"))
        size = int.from_bytes(data[start + 8 : start + 16], "little") + 16
        fatbin = tmp_path / "kernels.fatbin"
        fatbin.write_bytes(data[start : start + size])
        out = subprocess.run([tool, "--list-elf", str(fatbin)], capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if "ELF" in line]
        listed = sorted(line.rsplit(".", 2)[-2] for line in lines)  # "x.1.sm_80.cubin"
        assert listed == [f"sm_{sm}" for sm in sms]


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("sm", [80, 90])
def test_cuda_artifact(tiny_model_dir, tmp_path, sm):
    folder = _compile(tiny_model_dir("qwen3"), tmp_path, "cuda", [sm])
    _check_cuda_artifact(folder, [sm], tmp_path)
    # Loading it here (no driver, no GPU) fails with a clear message, in a fresh process
    # (this one has loaded the build-time driver stub).
    code = (
        "from tallow.runtime.model_runner import TVMModelRunner\n"
        "from tallow.runtime.errors import ArtifactError\n"
        "try:\n"
        f"    TVMModelRunner({str(folder)!r}, device='cuda')\n"
        "except ArtifactError as e:\n"
        "    print('ERROR', e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "TVM_USE_RUNTIME_LIB": "1"},
        timeout=120,
    )
    out = proc.stdout
    assert "ERROR cannot run on cuda: no CUDA driver or GPU found" in out, out + proc.stderr
    assert f"the artifact has: cuda sm_{sm} (lib/cuda-sm_{sm}.so)" in out


@pytest.mark.slow
@needs_nvcc
def test_cuda_moe_artifact(tiny_model_dir, tmp_path):
    """The grouped-expert kernels (routing, grouping, grouped matmuls) come scheduled for
    the GPU and build to sm_90 SASS beside dlight's kernels (Qwen2-MoE: shared expert too)."""
    from tallow.compiler.cuda_build import fatbin_entries

    folder = _compile(tiny_model_dir("qwen2_moe"), tmp_path, "cuda", [90])
    (lib,) = Manifest.read(folder).libraries
    kernels = lib.details["schedules"]["families"]
    moe = {k: v for k, v in kernels.items() if k.startswith("moe_")}
    assert {"moe_route", "moe_group", "moe_grouped_in", "moe_grouped_out"} <= set(moe), kernels
    assert all(set(v) == {"prescheduled"} for v in moe.values()), moe
    assert sorted(fatbin_entries(folder / lib.file)) == [("sass", 90)]


@pytest.mark.slow
def test_metal_artifact(tiny_model_dir, tmp_path):
    folder = _compile(tiny_model_dir("qwen3"), tmp_path, "metal")
    m = Manifest.read(folder)
    (lib,) = m.libraries
    assert lib.host["mtriple"] == "arm64-apple-macos"
    assert lib.details["shaders"] > 10 and lib.platform == "macos-arm64"
    assert lib.details["schedules"]["replaced_tvm_kernels"] == ["tir_attention_merge_state"]
    if find_ld64():  # linked here: one arm64 Mach-O dylib (tests/test_metal_dylib.py: its symbols)
        assert lib.file == "lib/metal-arm64.dylib"
        blob = (folder / lib.file).read_bytes()
        assert blob[:8] == MACHO_ARM64 and int.from_bytes(blob[12:16], "little") == 6  # MH_DYLIB
    else:
        assert lib.file == "lib/metal-arm64.tar"
        with tarfile.open(folder / lib.file) as tar:
            objects = {i.name: tar.extractfile(i).read() for i in tar.getmembers() if i.isfile()}
        assert objects and all(name.endswith(".o") for name in objects)
        assert all(data[:8] == MACHO_ARM64 for data in objects.values())  # arm64 Mach-O objects
        blob = b"".join(objects.values())
    assert b"metal" in blob and b"kernel void" in blob  # the shader module is packed inside


@pytest.mark.slow
@needs_nvcc
def test_tensor_cores_qwen3_0_6b_shape(tmp_path):
    """Qwen3-0.6B widths, 2 layers: prefill matmuls on tensor cores, as the manifest says."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from compile_shape import PRESETS, compile_shape

    info = compile_shape(
        PRESETS["qwen3-0.6b-2l"], "cuda", "f16", tmp_path, sms=[90], decode_buckets=()
    )
    details = info["target"]["details"]
    tc = details["schedules"]["tensor_core"]
    assert tc["tensorized_kernels"], tc
    # Every matmul the Matmul rule took on these widths is tensorized; none fell back.
    assert tc["matmul_kernels_without_tensor_cores"] == []
    assert details["tensor_core_in_source"] is True  # wmma::mma_sync in the CUDA source
    from tallow.compiler.cuda_build import fatbin_entries

    assert fatbin_entries(tmp_path / info["library"]) == [("sass", 90)]
