"""Compile targets as backend objects (`tallow.compiler.backends`): the registry, each
backend's target resolution and errors, the build report as the manifest records it, and a
made-up target defined in this one module that compiles a model the runtime runs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tallow.compiler.backends import (
    BACKENDS,
    BuildReport,
    TargetBackend,
    get_backend,
    register_backend,
    resolve_target,
    unregister_backend,
)
from tallow.compiler.backends.cpu import CPUBackend
from tallow.compiler.macho_link import find_ld64
from tallow.runtime.errors import TargetError
from tallow.runtime.manifest import Manifest

PROMPT_IDS = [11, 12, 13, 200, 201, 66, 8, 9, 10, 120]


# --- the registry ------------------------------------------------------------------------
def test_registry_lists_the_builtin_targets():
    assert list(BACKENDS)[:3] == ["cpu", "cuda", "metal"]
    for name in ("cpu", "cuda", "metal"):
        backend = get_backend(name)
        assert isinstance(backend, TargetBackend) and backend.name == name
        assert backend.device == name  # the manifest's target.kind, the runtime's device


def test_unknown_target_names_the_valid_ones():
    with pytest.raises(TargetError, match=r"target 'rocm' is not supported; supported: cpu, cuda"):
        get_backend("rocm")


def test_cli_target_choices_come_from_the_registry():
    from tallow.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["compile", "--model", "x", "--target", "rocm"])
    for name in BACKENDS:
        assert build_parser().parse_args(["compile", "--model", "x", "--target", name]).target


# --- target resolution ---------------------------------------------------------------------
def test_cpu_resolution():
    spec = resolve_target("cpu", "f32")
    assert spec.backend is get_backend("cpu") and spec.kind == "cpu"
    assert spec.tvm_target["kind"] == "llvm" and spec.host is None
    assert spec.tvm_target["mcpu"] == spec.report.mcpu
    assert spec.suffix == "cpu" and spec.library_name == f"lib/cpu-{spec.report.mcpu}.so"


def test_cuda_resolution():
    spec = resolve_target("cuda", "bf16", [120, 86])
    assert spec.tvm_target["arch"] == "sm_86"  # scheduled for the lowest requested arch
    assert spec.report.archs == ["sm_86", "sm_120"] and spec.report.scheduled_for == "sm_86"
    assert spec.suffix == "cuda-sm_86-sm_120" and spec.library_name == "lib/cuda-sm_86-sm_120.so"
    assert resolve_target("cuda", "f16").report.archs == ["sm_90"]  # the default arch


def test_metal_resolution():
    spec = resolve_target("metal", "f32")
    assert spec.tvm_target == {"kind": "metal"}
    assert spec.host == {"kind": "llvm", "mtriple": "arm64-apple-macos"}
    ext = ".dylib" if find_ld64() else ".tar"  # linked here by ld64.lld, else on the Mac
    assert spec.suffix == "metal" and spec.library_name == f"lib/metal-arm64{ext}"


@pytest.mark.parametrize(
    ("name", "dtype", "sms", "message"),
    [
        ("cuda", "f16", [75, 90], "--sm 75 is not supported; choose from 80, 86, 89, 90"),
        ("cuda", "f16", [91], "--sm 91 is not supported"),
        ("metal", "bf16", None, "bf16 is not supported on metal; use --dtype f16 or f32"),
        ("metal", "f16", [90], "--sm applies to --target cuda only"),
        ("cpu", "f32", [90], "--sm applies to --target cuda only"),
        ("cpu", "f64", None, "dtype 'f64' is not supported; choose one of f32, f16, bf16"),
        ("vulkan", "f16", None, "target 'vulkan' is not supported; supported: cpu, cuda, metal"),
    ],
)
def test_resolution_errors(name, dtype, sms, message):
    with pytest.raises(TargetError, match=message):
        resolve_target(name, dtype, sms)


def test_tensor_core_capability():
    assert get_backend("cuda").has_tensor_cores(resolve_target("cuda", "f16", [80]).tvm())
    assert get_backend("metal").has_tensor_cores(resolve_target("metal", "f16").tvm())
    assert not get_backend("cpu").has_tensor_cores(resolve_target("cpu", "f32").tvm())


# --- the build report ----------------------------------------------------------------------
def test_report_serialises_as_the_manifest_details_did():
    """The keys, in order, that each target's `target.details` held before backends existed."""
    cuda = BuildReport(archs=["sm_80"], scheduled_for="sm_80", mcpu=None)
    cuda.schedules, cuda.cuda_graph, cuda.tir_config = {"rules": {}}, {"enabled": True}, {}
    cuda.nvcc, cuda.build_driver = "13.0.48", "stub"
    cuda.kernels_in_source, cuda.tensor_core_in_source = 40, False
    assert list(cuda.to_details()) == [
        "archs",
        "scheduled_for",
        "tir_config",
        "schedules",
        "cuda_graph",
        "nvcc",
        "build_driver",
        "kernels_in_source",
        "tensor_core_in_source",
    ]
    metal = BuildReport(host_format="tar", tir_config={}, schedules={}, shaders=3)
    metal.tensor_core_in_source = True
    assert list(metal.to_details()) == [
        "host_format",
        "tir_config",
        "schedules",
        "shaders",
        "tensor_core_in_source",
    ]
    cpu = BuildReport(mcpu="znver4", decode_activations="float32", int8_decode_kernels=0)
    assert cpu.to_details() == {
        "mcpu": "znver4",
        "decode_activations": "float32",
        "int8_decode_kernels": 0,  # a zero is a fact, not an unset field
    }
    assert BuildReport().to_details() == {}


# --- a made-up target, in this module only ---------------------------------------------------
@dataclass
class DebugReport(BuildReport):
    tir_kernels: int | None = None  # PrimFuncs in the lowered module


class CPUDebugBackend(CPUBackend):
    """The CPU target plus one pass of its own, which counts the TIR kernels into its own
    report field. Its artifacts run on the CPU device (inherited `device`)."""

    name = "cpu-debug"

    def make_spec(self, dtype, sms, cpu=None):
        spec = super().make_spec(dtype, sms, cpu)
        spec.report = DebugReport(**vars(spec.report))
        return spec

    def passes_after_vm_lowering(self, spec, target):
        import tvm

        @tvm.transform.module_pass(opt_level=0, name="test.CountKernels")
        def count_kernels(mod, _ctx):
            funcs = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
            spec.report.tir_kernels = len(funcs)
            return mod

        return [*super().passes_after_vm_lowering(spec, target), count_kernels]


@pytest.fixture
def cpu_debug_backend():
    backend = register_backend(CPUDebugBackend())
    try:
        yield backend
    finally:
        unregister_backend(backend.name)
    assert "cpu-debug" not in BACKENDS


def test_registering_a_taken_name_fails(cpu_debug_backend):
    with pytest.raises(ValueError, match="already registered"):
        register_backend(CPUDebugBackend())


@pytest.mark.slow
def test_made_up_target_compiles_and_runs(
    cpu_debug_backend, tiny_model_dir, tiny_artifact, tmp_path
):
    from tallow.cli.main import build_parser
    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.generate import generate_tokens
    from tallow.runtime.model_runner import TVMModelRunner
    from tallow.runtime.sampling_params import SamplingParams

    args = build_parser().parse_args(["compile", "--model", "x", "--target", "cpu-debug"])
    assert args.target == ["cpu-debug"]  # the CLI offers it while it is registered
    opts = CompileOptions(model=str(tiny_model_dir("qwen3")), target="cpu-debug", output=tmp_path)
    opts.quiet = True
    folder = compile_model(opts)
    assert folder.name.endswith("-cpu-debug")
    manifest = Manifest.read(folder)
    (lib,) = manifest.libraries
    assert lib.device == "cpu" and lib.file == f"lib/cpu-debug-{lib.details['mcpu']}.so"
    details = lib.details
    assert details["tir_kernels"] > 10  # its own pass ran and its report reached the manifest
    assert details["mcpu"] == resolve_target("cpu", "f32").report.mcpu  # the CPU facts too
    # The same kernels as the cpu target's: the runtime loads it and decodes the same tokens.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = list(generate_tokens(TVMModelRunner(folder), PROMPT_IDS, params))
    reference = TVMModelRunner(tiny_artifact("qwen3", "f32"))
    assert tokens == list(generate_tokens(reference, PROMPT_IDS, params))
