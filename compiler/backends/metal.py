"""The Metal target: Apple GPUs, host code for arm64 macOS.

The host code is exported as a .tar of objects because this (Linux) machine cannot link a
macOS dylib; the Mac links it once at load time (docs/metal.md).
"""

from __future__ import annotations

from pathlib import Path

from tallow.runtime.errors import TargetError

from .base import BuildReport, TargetSpec
from .gpu import GPUBackend, count

HOST_FORMAT = "tar of arm64 Mach-O objects, linked on the Mac at load"


class MetalBackend(GPUBackend):
    name = "metal"

    def check_dtype(self, dtype: str) -> None:
        if dtype == "bf16":
            raise TargetError("bf16 is not supported on metal; use --dtype f16 or f32")

    def natural_dtype(self, model_dtype: str | None) -> str:
        return "f16"  # Apple GPUs have no bf16 arithmetic in TVM's Metal codegen

    def make_spec(self, dtype: str, sms: list[int] | None, cpu: str | None = None) -> TargetSpec:
        return TargetSpec(
            self,
            tvm_target={"kind": "metal"},
            host={"kind": "llvm", "mtriple": "arm64-apple-macos"},
            report=BuildReport(host_format=HOST_FORMAT),
            platform="macos-arm64",
        )

    def library_stem(self, spec: TargetSpec) -> str:
        return "metal-arm64"

    def library_ext(self, spec: TargetSpec) -> str:
        return ".tar"

    def target_label(self, spec: TargetSpec) -> str:
        return "metal (Apple silicon)"

    def has_tensor_cores(self, target) -> bool:
        return True  # simdgroup matrices (Apple7+ GPUs)

    def build(self, mod, spec: TargetSpec, path: Path) -> None:
        import tvm

        target = spec.tvm()
        with target, self.pass_context(spec):
            executable = tvm.compile(mod, target, relax_pipeline=None)
        # A .tar of the arm64 host objects plus the packed shader module: Linux cannot link
        # a Mach-O dylib; the Mac links it once at load time (docs/metal.md).
        source = _shader_source(executable)
        spec.report.shaders = count(r"kernel void ", source)
        spec.report.tensor_core_in_source = "simdgroup_multiply_accumulate" in source
        executable.export_library(str(path))


def _shader_source(executable) -> str:
    """The Metal source of the shader module imported by the built library."""
    lib = executable.mod if hasattr(executable, "mod") else executable
    modules: dict = {}
    for m in lib.imports:
        for sub in (m, *m.imports):
            modules.setdefault(sub.kind, sub)
    shaders = modules.get("metal")
    return shaders.inspect_source() if shaders is not None else ""
