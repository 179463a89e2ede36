"""Per-target TensorIR schedules, applied once the Relax pipeline has fused the kernels."""

from __future__ import annotations


def schedule_pass_for(spec, target):
    """A module pass that schedules every TIR kernel for `spec`'s target.

    GPU targets also write which rule each kernel got into `spec.details["schedules"]`,
    which the manifest records.
    """
    import tvm

    if spec.kind == "cpu":
        from .cpu import rules as cpu

        def schedule(mod):
            return cpu.schedule_module(mod, target)
    else:
        from .gpu import rules as gpu

        def schedule(mod):
            return gpu.schedule_module(mod, target, spec.details.setdefault("schedules", {}))

    @tvm.transform.module_pass(opt_level=0, name=f"tallow.schedules.{spec.kind}")
    def _pass(mod, _ctx):
        return schedule(mod)

    return _pass
