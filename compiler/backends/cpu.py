"""The CPU target: LLVM code for the build machine's CPU, exported as one shared library.

Relax additions: SiLU with a polynomial exp in place of libm's (`fast_silu_pass.py`), on x86
CPUs with AVX2 the int8-activation kernels for decode's quantized matmuls
(`int8_decode_pass.py`), and `tirx.noalias` on every kernel before code generation
(`noalias_pass.py`). Kernels are scheduled by `schedules/cpu/rules.py`.
"""

from __future__ import annotations

from pathlib import Path

from .base import BuildReport, TargetBackend, TargetSpec


class CPUBackend(TargetBackend):
    name = "cpu"

    def make_spec(self, dtype: str, sms: list[int] | None) -> TargetSpec:
        cpu = _host_cpu()
        tvm_target = {"kind": "llvm", "mcpu": cpu}
        if _has_sse4a(cpu):
            # AMD's SSE4a `insertq`, which LLVM picks to build a vector from 16-bit loads, is
            # legacy-encoded: between AVX instructions it stalled the column decode kernel
            # (q4_0, 16 sequences: 1.30 ms with it, 0.45 ms without).
            tvm_target["mattr"] = ["-sse4a"]
        return TargetSpec(self, tvm_target, report=BuildReport(mcpu=cpu))

    def passes_before_fusion(self, spec: TargetSpec, target) -> list:
        from ..fast_silu_pass import fast_silu
        from ..int8_decode_pass import int8_decode_kernels

        passes = [fast_silu()]
        if self.has_int8_decode(target):
            vnni = self.has_avx512_vnni(target)
            passes.append(int8_decode_kernels(spec.report, vnni=vnni))
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


def _host_cpu() -> str:
    import tvm

    get = tvm.get_global_func("target.llvm_get_system_cpu", allow_missing=True)
    return str(get()) if get is not None else "generic"


def _has_sse4a(cpu: str) -> bool:
    from tvm.target import Target, codegen

    try:
        return bool(codegen.target_has_features("sse4a", Target({"kind": "llvm", "mcpu": cpu})))
    except Exception:  # noqa: BLE001 - an LLVM without x86 support has no such feature
        return False
