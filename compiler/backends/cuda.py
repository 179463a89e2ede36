"""The CUDA target: one library with SASS for every requested SM architecture.

One library may carry SASS for several architectures (`--sm 80 --sm 90`). TIR is scheduled
once, for the lowest requested arch (its features are a subset of the others'), and
`compiler/cuda_build.py` compiles that code for every arch into one fatbin (no driver needed).

CUDA graphs: `RewriteCUDAGraph` runs after memory planning (the order of TVM's own CUDA
pipeline), so a graph replays fixed buffers. It needs statically planned memory:
`batch_decode` gets an upper bound on `batch_size` (`tir_var_upper_bound`), and the attribute
`relax.rewrite_cuda_graph.capture_symbolic_vars` lets the pass capture regions whose shapes
depend on `batch_size`: the VM then keeps one graph per batch size it meets
(`vm.builtin.cuda_graph.run_or_capture` keys its cache on the shape values), and the runtime
rounds every step up to one of `CUDA_GRAPH_BATCH_BUCKETS` (`runtime/decode_padding.py`).
Each bucket also gets a static-row `batch_decode_b<n>` (`static_decode_buckets`), which the
runner calls instead: static shapes need no bound, and their quantized matmuls take
`QuantDecodeGEMV` (weights read once for all rows) where the symbolic batch gets dlight's
`LowBatchGEMV` (one pass over the weights per 4 rows). The symbolic `batch_decode` stays as
the fallback for batch sizes without a bucket function.
The paged KV cache's attention calls take per-step page tables, so they stay outside the
graphs: each layer's kernels between two attention calls are one captured region. What was
captured is recorded in the manifest (`target.details.cuda_graph`).
"""

from __future__ import annotations

import re
from pathlib import Path

from tallow.runtime.cpu_features import host_platform
from tallow.runtime.errors import TargetError

from .base import BuildReport, TargetSpec
from .gpu import GPUBackend

# Architectures we build and test for (Ampere, Ampere GA10x, Ada, Hopper, Blackwell DC/RTX).
CUDA_SMS = (80, 86, 89, 90, 100, 120)

# Largest decode batch a CUDA graph is captured for (the runner caps its batch to this).
CUDA_GRAPH_MAX_BATCH = 64
# Tensor-core instructions in generated CUDA: wmma (what dlight emits) or inline PTX mma.
TENSOR_CORE_CALLS = r"wmma::mma_sync|mma\.sync"
_GRAPH_BOUNDS = {"batch_decode": {"batch_size": CUDA_GRAPH_MAX_BATCH}}
_CAPTURE_VARS = "relax.rewrite_cuda_graph.capture_symbolic_vars"
# Batch sizes the runtime rounds a decode batch up to, so at most this many graphs exist.
CUDA_GRAPH_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class CUDABackend(GPUBackend):
    name = "cuda"
    accepts_sms = True

    def natural_dtype(self, model_dtype: str | None) -> str:
        # The model's own half type (bf16 needs sm_80, which every CUDA_SMS arch has); f16
        # for f32 checkpoints and GGUF files, as llama.cpp computes on CUDA.
        return model_dtype if model_dtype in ("bf16", "f16") else "f16"

    def make_spec(self, dtype: str, sms: list[int] | None, cpu: str | None = None) -> TargetSpec:
        sms = sorted(set(sms or [90]))
        bad = [sm for sm in sms if sm not in CUDA_SMS]
        if bad:
            raise TargetError(
                f"--sm {', '.join(map(str, bad))} is not supported; choose from "
                f"{', '.join(map(str, CUDA_SMS))}"
            )
        if dtype == "bf16" and sms[0] < 80:  # unreachable with CUDA_SMS today; kept as the rule
            raise TargetError(f"bf16 needs sm_80 or newer; sm_{sms[0]} has no bf16 arithmetic")
        archs = [f"sm_{sm}" for sm in sms]
        return TargetSpec(
            self,
            # 48 KiB is the shared memory every arch gives a block without an opt-in; stating
            # it keeps dlight from guessing (it assumes the same value, with a warning per
            # kernel).
            tvm_target={
                "kind": "cuda",
                "arch": archs[0],
                "max_shared_memory_per_block": 49152,
                "max_threads_per_block": 1024,
                "thread_warp_size": 32,
            },
            host={"kind": "llvm"},  # generic x86-64 host code: runs on any GPU server's CPU
            report=BuildReport(archs=archs, scheduled_for=archs[0]),
            platform=host_platform(),
        )

    def artifact_suffix(self, spec: TargetSpec) -> str:
        return "cuda-" + "-".join(spec.report.archs)

    def target_label(self, spec: TargetSpec) -> str:
        return "cuda " + " ".join(spec.report.archs)

    def has_tensor_cores(self, target) -> bool:
        arch = str(target.attrs.get("arch", ""))
        return arch.startswith("sm_") and int(arch[3:]) >= 70

    def static_decode_buckets(self) -> tuple[int, ...]:
        return CUDA_GRAPH_BATCH_BUCKETS

    # --- CUDA graphs ----------------------------------------------------------------------
    def pass_config(self) -> dict:
        return {"relax.backend.use_cuda_graph": True}

    def prepare_for_lowering(self, mod, spec: TargetSpec):
        """Attach `tir_var_upper_bound` so CUDA-graph functions get statically planned memory."""
        from tvm import relax

        for gv, func in list(mod.functions_items()):
            bounds = _GRAPH_BOUNDS.get(gv.name_hint)
            if bounds and isinstance(func, relax.Function):
                func = func.with_attr("tir_var_upper_bound", bounds)
                func = func.with_attr(_CAPTURE_VARS, list(bounds))
                mod[gv] = func
        return mod

    def passes_after_memory_planning(self, spec: TargetSpec, target) -> list:
        from tvm.relax import transform as T

        return [T.RewriteCUDAGraph()]

    def after_lowering(self, mod, spec: TargetSpec) -> None:
        spec.report.cuda_graph = _graph_report(mod)

    # --- build ----------------------------------------------------------------------------
    def build(self, mod, spec: TargetSpec, path: Path) -> None:
        import tvm

        from ..cuda_build import (
            ensure_cuda_codegen,
            kernels_with,
            nvcc_callback,
            nvcc_version,
            ptxas_resources,
        )

        report = spec.report
        report.nvcc = nvcc_version()
        report.build_driver = ensure_cuda_codegen().split(":")[0]
        target = spec.tvm()
        sms = [int(arch[3:]) for arch in report.archs]
        record: dict = {}
        with target, self.pass_context(spec), nvcc_callback(sms, record):
            executable = tvm.compile(mod, target, relax_pipeline=None)
        source = record.get("cuda_source", "")
        report.kernels_in_source = len(kernels_with(source, ""))  # declared once, defined once
        report.tensor_core_in_source = bool(re.search(TENSOR_CORE_CALLS, source))
        report.tensor_core_kernels = kernels_with(source, TENSOR_CORE_CALLS)
        resources = ptxas_resources(record.get("ptxas", ""))
        report.spills = {
            kernel: {arch: r for arch, r in per_arch.items() if r.get("spill_stores")}
            for kernel, per_arch in resources.items()
            if any(r.get("spill_stores") for r in per_arch.values())
        }
        report.kernel_resources = resources
        report.spill_repair = record.get("spill_repair", {})  # see compiler/launch_bounds.py
        if report.static_decode_functions:
            report.static_decode_evidence = _static_decode_evidence(report)
        executable.export_library(str(path))


def _static_decode_evidence(report: BuildReport) -> dict:
    """Per static-row batch decode: the rules its quantized matmuls got, their most registers
    per arch, and the ones that spill (the claim: all QuantDecodeGEMV, none spilling)."""
    rules = (report.schedules or {}).get("static_decode", {})
    resources = report.kernel_resources or {}
    out = {}
    for rows, fn in report.static_decode_functions.items():
        kernels = rules.get(fn, {})
        per_arch = [resources.get(f"{k}_kernel", {}) for k in kernels]
        archs = sorted({a for r in per_arch for a in r})
        out[fn] = {
            "rows": int(rows),
            "quant_matmul_rules": sorted(set(kernels.values())),
            "quant_matmuls": len(kernels),
            "max_registers": {
                a: max((r[a].get("registers", 0) for r in per_arch if a in r), default=0)
                for a in archs
            },
            "spilled": sorted(
                k
                for k in kernels
                if any(
                    r.get("spill_stores") or r.get("spill_loads")
                    for r in resources.get(f"{k}_kernel", {}).values()
                )
            ),
        }
    return out


def _graph_report(mod) -> dict:
    """Which Relax functions RewriteCUDAGraph captured (the manifest records it as found)."""
    from tvm import relax

    from tallow.schedules.gpu.rules import is_decode_function

    captured, not_captured, regions = [], [], {}
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and is_decode_function(gv.name_hint):
            calls = func.script().count("cuda_graph.run_or_capture")
            (captured if calls else not_captured).append(gv.name_hint)
            regions[gv.name_hint] = calls
    report = {
        "enabled": bool(captured),
        "max_batch_size": CUDA_GRAPH_MAX_BATCH,
        "batch_buckets": list(CUDA_GRAPH_BATCH_BUCKETS),
        "captured_functions": sorted(captured),
        "captured_regions": regions,  # run_or_capture calls per function
    }
    if not_captured:
        # Seen with TVM 0.27: the symbolic-batch batch_decode is not captured even with a
        # batch_size upper bound (its memory is still planned statically for the bound).
        report["not_captured"] = sorted(not_captured)
        report["reason"] = "RewriteCUDAGraph found no capturable region (TVM 0.27)"
    return report
