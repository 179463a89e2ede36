"""Lowering (Relax → scheduled TIR → VM code) and building the runtime library.

The pass list is TVM's CPU pipeline with two additions that matter for speed:
`FuseTransposeMatmul` (so `x @ W.T` reads W in place instead of transposing it on every
call) and our per-target schedules, applied once the kernels are fused.
"""

from __future__ import annotations

from pathlib import Path

from .target import TargetSpec


def _passes(spec: TargetSpec, target):
    from tvm import relax
    from tvm.relax import transform as T

    from tallow.schedules import schedule_pass_for

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
        schedule_pass_for(spec, target),
        T.RewriteDataflowReshape(),
        T.ToNonDataflow(),
        T.RemovePurityChecking(),
        T.CallTIRRewrite(),
        T.StaticPlanBlockMemory(),
        T.LowerAllocTensor(),
        T.KillAfterLastUse(),
        T.LowerRuntimeBuiltin(),
        T.ComputePrimValue(),
        T.VMShapeLower(),
        T.AttachGlobalSymbol(),
    ]


def lower_module(mod, spec: TargetSpec):
    """Run the Relax pipeline: fuse, legalize, schedule, and lower to VM code."""
    import tvm

    target = spec.tvm()
    with target:
        return tvm.transform.Sequential(_passes(spec, target))(mod)


def build_module(mod, spec: TargetSpec, path: Path) -> None:
    """Generate machine code for the lowered module and write one shared library."""
    import tvm

    target = spec.tvm()
    with target:
        executable = tvm.compile(mod, target, relax_pipeline=None)
    executable.export_library(str(path))
