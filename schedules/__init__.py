"""Per-target TensorIR schedules, applied after the Relax pipeline has lowered to TIR."""

from __future__ import annotations


def schedule_pass_for(spec):
    """The module pass that schedules every TIR function for `spec`'s target."""
    from . import cpu

    passes = {"cpu": cpu.schedule_module}
    return passes[spec.kind]
