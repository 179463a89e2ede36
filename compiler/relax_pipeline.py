"""Lowering (Relax → TIR with our schedules) and building the runtime library."""

from __future__ import annotations

from pathlib import Path

from .target import TargetSpec


def lower_module(mod, spec: TargetSpec):
    """Run the target's Relax pipeline: dispatch, legalize, fuse, schedule, lower to VM code."""
    import tvm
    from tvm import relax

    from tallow.schedules import schedule_pass_for

    target = spec.tvm()
    with target:
        pipeline = relax.pipeline.get_default_pipeline(target)
        mod = pipeline(mod)
        mod = schedule_pass_for(spec)(mod)
    return tvm.ir.transform.Sequential([])(mod)


def build_module(mod, spec: TargetSpec, path: Path) -> None:
    """Generate machine code for the lowered module and write one shared library."""
    import tvm

    target = spec.tvm()
    with target:
        executable = tvm.compile(mod, target, relax_pipeline=None)
    executable.export_library(str(path))
