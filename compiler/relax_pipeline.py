"""Lowering (Relax → scheduled TIR → VM code): one pass list for every target, with hooks
the target's backend (`compiler/backends/`) fills.

The list is TVM's CPU pipeline with additions that matter for speed: `FuseTransposeMatmul`
(so `x @ W.T` reads W in place instead of transposing it on every call) and the target's
schedules, applied once the kernels are fused. The hooks, in pipeline order:

* `prepare_for_lowering` – attributes the passes read (CUDA: upper bounds on symbolic vars);
* `passes_before_fusion` – rewrites of the model's operators (CPU: fast SiLU, int8 decode);
* `schedule_pass` – schedules every fused TIR kernel (`schedules/cpu/`, `schedules/gpu/`);
* `passes_after_memory_planning` – (CUDA: `RewriteCUDAGraph`, TVM's own CUDA order);
* `passes_after_vm_lowering` – (CPU: `tirx.noalias` on every kernel);
* `after_lowering` – the backend records what lowering did in the build report.

All of it runs inside the TVM target and the backend's `pass_context`.
"""

from __future__ import annotations

from .backends.base import TargetSpec


def fusion_passes() -> list:
    """Relax → fused TIR kernels, before any schedule."""
    from tvm import relax
    from tvm.relax import transform as T

    return [
        T.FuseTransposeMatmul(),
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        T.LegalizeOps(),
        T.AnnotateTIROpPattern(),
        T.FoldConstant(),
        T.FuseOps(),
        T.FuseTIR(),
        T.DeadCodeElimination(),
    ]


def vm_lowering_passes(after_memory_planning: list | None = None) -> list:
    """Scheduled module → VM code; `after_memory_planning` runs right after memory planning."""
    from tvm.relax import transform as T

    return [
        T.RewriteDataflowReshape(),
        T.ToNonDataflow(),
        T.RemovePurityChecking(),
        T.CallTIRRewrite(),
        T.StaticPlanBlockMemory(),
        *(after_memory_planning or []),
        T.LowerAllocTensor(),
        T.KillAfterLastUse(),
        T.LowerRuntimeBuiltin(),
        T.ComputePrimValue(),
        T.VMShapeLower(),
        T.AttachGlobalSymbol(),
    ]


def relax_passes(spec: TargetSpec, target) -> list:
    """The whole pass list for `spec`'s target (`target`: `spec.tvm()`)."""
    backend = spec.backend
    return [
        *backend.passes_before_fusion(spec, target),
        *fusion_passes(),
        backend.schedule_pass(spec, target),
        *vm_lowering_passes(backend.passes_after_memory_planning(spec, target)),
        *backend.passes_after_vm_lowering(spec, target),
    ]


def lower_module(mod, spec: TargetSpec):
    """Run the Relax pipeline: fuse, legalize, schedule, and lower to VM code."""
    import tvm

    backend = spec.backend
    target = spec.tvm()
    mod = backend.prepare_for_lowering(mod, spec)
    with target, backend.pass_context(spec):
        mod = tvm.transform.Sequential(relax_passes(spec, target))(mod)
    backend.after_lowering(mod, spec)
    return mod
