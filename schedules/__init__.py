"""Per-target TensorIR schedules, applied once the Relax pipeline has fused the kernels."""

from __future__ import annotations


def schedule_pass_for(spec, target):
    """A module pass that schedules every TIR kernel for `spec`'s target."""
    import tvm

    from . import cpu

    rules = {"cpu": cpu.schedule_module}
    schedule = rules[spec.kind]

    @tvm.transform.module_pass(opt_level=0, name=f"tallow.schedules.{spec.kind}")
    def _pass(mod, _ctx):
        return schedule(mod, target)

    return _pass
