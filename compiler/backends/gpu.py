"""What the GPU targets (CUDA, Metal; later ROCm, Vulkan) share: dlight schedules with a
per-kernel report, the TIR configuration, and the GPU token-sampler kernel."""

from __future__ import annotations

import re

from .base import TargetBackend, TargetSpec

# TIR common-subexpression elimination miscompiles the KV cache's `batch_tree_attn` kernel
# in TVM 0.27 for CUDA and Metal ("cse_v12 has been used before definition"). nvcc and the
# Metal compiler eliminate common subexpressions themselves, so we turn the TIR pass off.
GPU_TIR_CONFIG = {"tirx.disable_cse_tir": True}


class GPUBackend(TargetBackend):
    """Kernels scheduled by `schedules/gpu/rules.py`, which records in the report which rule
    each kernel got (`target.details.schedules`)."""

    def schedule_pass(self, spec: TargetSpec, target):
        import tvm

        from tallow.schedules.gpu.merge_state import replace_merge_state
        from tallow.schedules.gpu.rules import schedule_module

        tensor_cores = self.has_tensor_cores(target)

        @tvm.transform.module_pass(opt_level=0, name=f"tallow.schedules.{self.name}")
        def _pass(mod, _ctx):
            if spec.report.schedules is None:
                spec.report.schedules = {}
            # the paged cache's merge kernel: TVM's races on S (schedules/gpu/merge_state.py)
            replaced = replace_merge_state(mod)
            spec.report.schedules["replaced_tvm_kernels"] = replaced
            return schedule_module(mod, target, spec.report.schedules, tensor_cores)

        return _pass

    def check_formats(self, types: dict) -> None:
        from tallow.compiler.quant.registry import QUANT_FORMATS
        from tallow.runtime.errors import TargetError

        for name, kinds in types.items():
            for kind in (kinds,) if isinstance(kinds, str) else kinds:
                fmt = QUANT_FORMATS.get(kind)
                if fmt is not None and not fmt.gpu:
                    raise TargetError(
                        f"--target {self.name}: weight {name} is {fmt.ggml_type.name}, a block "
                        f"type the GPU schedules do not take (yet); compile it for the cpu"
                    )

    def pass_config(self) -> dict:
        """PassContext configuration beyond `GPU_TIR_CONFIG`."""
        return {}

    def pass_context(self, spec: TargetSpec):
        import tvm

        spec.report.tir_config = dict(GPU_TIR_CONFIG)
        return tvm.transform.PassContext(config={**GPU_TIR_CONFIG, **self.pass_config()})

    def sampler_kernels(self):
        from tallow.schedules.gpu import sampling

        return sampling


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))
