"""The CPU target: LLVM code for a CPU level (`--cpu`, `compiler/cpu_levels.py`; default the
build machine's own CPU), exported as one shared library (or a .tar of objects for a machine
of another architecture, linked there at first load).

Relax additions: SiLU and GELU (tanh form) with a polynomial exp in place of libm's
(`fast_silu_pass.py`, `fast_gelu_pass.py`), on x86
CPUs with AVX2 the int8-activation kernels for decode's quantized matmuls
(`int8_decode_pass.py`), with AVX-512 VNNI for prefill's too (`int8_prefill_pass.py`), and
`tirx.noalias` on every kernel before code generation (`noalias_pass.py`). Kernels are
scheduled by `schedules/cpu/rules.py`.

"""

from __future__ import annotations

from pathlib import Path

from ..cpu_levels import LEVELS, required_features, resolve_level
from .base import BuildReport, TargetBackend, TargetSpec


class CPUBackend(TargetBackend):
    name = "cpu"
    accepts_cpu_level = True

    def make_spec(self, dtype: str, sms: list[int] | None, cpu: str | None = None) -> TargetSpec:
        level = resolve_level(cpu)
        target = dict(level.tvm_target)
        return TargetSpec(
            self,
            target,
            # every CPU level's decode kernels reduce a row in one order whatever the batch
            # (tests/test_deterministic.py checks each level's schedules)
            report=BuildReport(mcpu=target.get("mcpu", "generic"), batch_invariant_decode=True),
            platform=level.platform,
            cpu_level=level.name,
            cpu_features=required_features(target, level.platform),
        )

    def artifact_suffix(self, spec: TargetSpec) -> str:
        return self.name if spec.cpu_level == "native" else f"{self.name}-{spec.cpu_level}"

    def library_stem(self, spec: TargetSpec) -> str:
        # native: named by the CPU it was tuned for (cpu-znver4); a level by the level.
        if spec.cpu_level == "native":
            return f"{self.name}-{spec.report.mcpu}"
        return f"{self.name}-{spec.cpu_level}"

    def library_ext(self, spec: TargetSpec) -> str:
        linked_here = spec.cpu_level == "native" or LEVELS[spec.cpu_level].linked_here
        return ".so" if linked_here else ".tar"

    def target_label(self, spec: TargetSpec) -> str:
        if spec.cpu_level == "native":
            return f"cpu native ({spec.report.mcpu})"
        return f"cpu {spec.cpu_level}"

    def passes_before_fusion(self, spec: TargetSpec, target) -> list:
        from ..fast_gelu_pass import fast_gelu_tanh
        from ..fast_silu_pass import fast_silu
        from ..int8_decode_pass import int8_decode_kernels
        from ..int8_prefill_pass import int8_prefill_kernels

        passes = [fast_silu(), fast_gelu_tanh()]
        if self.has_int8_decode(target):
            vnni = self.has_avx512_vnni(target)
            passes.append(int8_decode_kernels(spec.report, vnni=vnni))
            amx = vnni and self.has_amx_bf16(target)
            passes.append(int8_prefill_kernels(spec.report, vnni=vnni, amx=amx))
        return passes

    def schedule_pass(self, spec: TargetSpec, target):
        import tvm

        from tallow.schedules.cpu.rules import schedule_module

        @tvm.transform.module_pass(opt_level=0, name=f"tallow.schedules.{self.name}")
        def _pass(mod, _ctx):
            return schedule_module(mod, target)

        return _pass

    def passes_after_vm_lowering(self, spec: TargetSpec, target) -> list:
        from ..noalias_pass import mark_noalias

        return [mark_noalias()]

    def build(self, mod, spec: TargetSpec, path: Path) -> None:
        import tvm

        target = spec.tvm()
        with target, self.pass_context(spec):
            executable = tvm.compile(mod, target, relax_pipeline=None)
        executable.export_library(str(path))

    def sampler_kernels(self):
        from tallow.schedules.cpu import sampling

        return sampling

    # --- capabilities ---------------------------------------------------------------------
    def has_int8_decode(self, target) -> bool:
        """x86 with AVX2: decode's quantized matmuls can take int8-activation kernels."""
        from tallow.schedules.cpu import int8_gemv

        return int8_gemv.supported(target)

    def has_avx512_vnni(self, target) -> bool:
        from tallow.schedules.cpu import int8_vnni

        return int8_vnni.supported(target)

    def has_amx_bf16(self, target) -> bool:
        """AMX tiles with bf16 products (Sapphire Rapids and newer): prefill's matmuls take
        them (`schedules.cpu.amx_prefill`)."""
        from tallow.schedules.cpu import amx_prefill

        return amx_prefill.supported(target)
