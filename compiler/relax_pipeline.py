"""Lowering (Relax → scheduled TIR → VM code) and building the runtime library.

The pass list is TVM's CPU pipeline with additions that matter for speed:
`FuseTransposeMatmul` (so `x @ W.T` reads W in place instead of transposing it on every
call), our per-target schedules, applied once the kernels are fused, and on x86 CPUs with
AVX2 the int8-activation kernels for decode's quantized matmuls (`int8_decode_pass.py`);
on CPUs, SiLU with a polynomial exp in place of libm's (`fast_silu_pass.py`).

GPU targets (CUDA, Metal) use the same list with the dlight schedules of `schedules/gpu.py`
in place of the CPU ones and, for CUDA, `RewriteCUDAGraph` after memory planning (the order
of TVM's own CUDA pipeline). CUDA graphs need statically planned memory: `batch_decode`
gets an upper bound on `batch_size` (`tir_var_upper_bound`). What was captured is recorded
in the manifest (`target.details.cuda_graph`). CUDA builds go through `cuda_build.py`
(one fatbin, SASS for every requested arch; no driver needed).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from .target import TargetSpec

log = logging.getLogger(__name__)

# Largest decode batch a CUDA graph is captured for (the runner caps its batch to this).
CUDA_GRAPH_MAX_BATCH = 32
_GRAPH_BOUNDS = {"batch_decode": {"batch_size": CUDA_GRAPH_MAX_BATCH}}


def _passes(spec: TargetSpec, target):
    from tvm import relax
    from tvm.relax import transform as T

    from tallow.schedules import schedule_pass_for
    from tallow.schedules.cpu import int8_gemv, int8_vnni

    from .fast_silu_pass import fast_silu
    from .int8_decode_pass import int8_decode_kernels
    from .noalias_pass import mark_noalias

    # CUDA graphs: captured after memory planning, so the graph replays fixed buffers.
    graphs = [T.RewriteCUDAGraph()] if spec.kind == "cuda" else []
    noalias = [mark_noalias()] if spec.kind == "cpu" else []
    silu = [fast_silu()] if spec.kind == "cpu" else []
    int8_decode = (
        [int8_decode_kernels(spec.details, vnni=int8_vnni.supported(target))]
        if int8_gemv.supported(target)
        else []
    )
    return [
        *silu,
        *int8_decode,
        T.FuseTransposeMatmul(),
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        T.LegalizeOps(),
        T.AnnotateTIROpPattern(),
        T.FoldConstant(),
        T.FuseOps(),
        T.FuseTIR(),
        T.DeadCodeElimination(),
        schedule_pass_for(spec, target),
        T.RewriteDataflowReshape(),
        T.ToNonDataflow(),
        T.RemovePurityChecking(),
        T.CallTIRRewrite(),
        T.StaticPlanBlockMemory(),
        *graphs,
        T.LowerAllocTensor(),
        T.KillAfterLastUse(),
        T.LowerRuntimeBuiltin(),
        T.ComputePrimValue(),
        T.VMShapeLower(),
        T.AttachGlobalSymbol(),
        *noalias,
    ]


# TIR common-subexpression elimination miscompiles the KV cache's `batch_tree_attn` kernel
# in TVM 0.27 for CUDA and Metal ("cse_v12 has been used before definition"). nvcc and the
# Metal compiler eliminate common subexpressions themselves, so we turn the TIR pass off.
GPU_TIR_CONFIG = {"tirx.disable_cse_tir": True}


def _pass_context(spec: TargetSpec):
    import tvm

    config = dict(GPU_TIR_CONFIG)
    if spec.kind == "cuda":
        config["relax.backend.use_cuda_graph"] = True
    spec.details["tir_config"] = dict(GPU_TIR_CONFIG)
    return tvm.transform.PassContext(config=config)


def _bound_symbolic_vars(mod):
    """Attach `tir_var_upper_bound` so CUDA-graph functions get statically planned memory."""
    from tvm import relax

    for gv, func in list(mod.functions_items()):
        bounds = _GRAPH_BOUNDS.get(gv.name_hint)
        if bounds and isinstance(func, relax.Function):
            mod[gv] = func.with_attr("tir_var_upper_bound", bounds)
    return mod


def _graph_report(mod) -> dict:
    """Which Relax functions RewriteCUDAGraph captured (the manifest records it as found)."""
    from tvm import relax

    captured, not_captured = [], []
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and gv.name_hint in ("decode", "batch_decode"):
            graph = "cuda_graph.run_or_capture" in func.script()
            (captured if graph else not_captured).append(gv.name_hint)
    report = {
        "enabled": bool(captured),
        "max_batch_size": CUDA_GRAPH_MAX_BATCH,
        "captured_functions": sorted(captured),
    }
    if not_captured:
        # Seen with TVM 0.27: the symbolic-batch batch_decode is not captured even with a
        # batch_size upper bound (its memory is still planned statically for the bound).
        report["not_captured"] = sorted(not_captured)
        report["reason"] = "RewriteCUDAGraph found no capturable region (TVM 0.27)"
    return report


def lower_module(mod, spec: TargetSpec):
    """Run the Relax pipeline: fuse, legalize, schedule, and lower to VM code."""
    import tvm

    target = spec.tvm()
    if spec.kind == "cpu":
        with target:
            return tvm.transform.Sequential(_passes(spec, target))(mod)
    if spec.kind == "cuda":
        mod = _bound_symbolic_vars(mod)
    with target, _pass_context(spec):
        mod = tvm.transform.Sequential(_passes(spec, target))(mod)
    if spec.kind == "cuda":
        spec.details["cuda_graph"] = _graph_report(mod)
    return mod


def build_module(mod, spec: TargetSpec, path: Path) -> None:
    """Generate machine code for the lowered module and write one shared library."""
    import tvm

    target = spec.tvm()
    if spec.kind == "cuda":
        return _build_cuda(mod, spec, target, path)
    if spec.kind == "cpu":
        with target:
            executable = tvm.compile(mod, target, relax_pipeline=None)
        executable.export_library(str(path))
        return None
    with target, _pass_context(spec):
        executable = tvm.compile(mod, target, relax_pipeline=None)
    if spec.kind == "metal":
        # A .tar of the arm64 host objects plus the packed shader module: Linux cannot link
        # a Mach-O dylib; the Mac links it once at load time (docs/metal.md).
        source = _device_source(executable, "metal")
        spec.details["shaders"] = _count(r"kernel void ", source)
        spec.details["tensor_core_in_source"] = "simdgroup_multiply_accumulate" in source
        executable.export_library(str(path))
    return None


def _device_source(executable, kind: str) -> str:
    lib = executable.mod if hasattr(executable, "mod") else executable
    for m in lib.imports:
        for sub in [m, *m.imports]:
            if sub.kind == kind:
                return sub.inspect_source()
    return ""


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def _build_cuda(mod, spec: TargetSpec, target, path: Path) -> None:
    import tvm

    from .cuda_build import ensure_cuda_codegen, nvcc_callback, nvcc_version

    spec.details["nvcc"] = nvcc_version()
    spec.details["build_driver"] = ensure_cuda_codegen().split(":")[0]
    record: dict = {}
    with target, _pass_context(spec), nvcc_callback(spec.sms, record):
        executable = tvm.compile(mod, target, relax_pipeline=None)
    source = record.get("cuda_source", "")
    spec.details["kernels_in_source"] = _count(r'extern "C" __global__', source)
    spec.details["tensor_core_in_source"] = bool(re.search(r"wmma::mma_sync|mma\.sync", source))
    executable.export_library(str(path))
    return None
