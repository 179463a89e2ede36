"""The Metal target: Apple GPUs, host code for arm64 macOS.

The library is linked here, at compile time, into an arm64 dylib (`lib/metal-arm64.dylib`)
with LLVM's `ld64.lld` (`compiler/macho_link.py`), so a Mac needs only `pip install` to run
it. When this machine has no `ld64.lld`, the objects ship as a .tar instead
(`lib/metal-arm64.tar`) and the Mac links them once at load time with its own `clang` (the
Xcode command line tools; docs/metal.md); the manifest's `host_format` and `linker` say which.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from tallow.runtime.errors import TargetError

from ..macho_link import export_fcompile, find_ld64, ld64_version
from .base import BuildReport, TargetSpec
from .gpu import GPUBackend, count

log = logging.getLogger(__name__)

HOST_FORMAT_DYLIB = "arm64 Mach-O dylib, linked at compile time"
HOST_FORMAT_TAR = "tar of arm64 Mach-O objects, linked on the Mac at load"
NO_LINKER = "none: ld64.lld (Debian lld) was not found at compile time; the Mac links with clang"


@dataclass
class MetalBuildReport(BuildReport):
    linker: str | None = None  # the linker that made the dylib, or why there is none


class MetalBackend(GPUBackend):
    name = "metal"

    def check_dtype(self, dtype: str) -> None:
        if dtype == "bf16":
            raise TargetError("bf16 is not supported on metal; use --dtype f16 or f32")

    def natural_dtype(self, model_dtype: str | None) -> str:
        return "f16"  # Apple GPUs have no bf16 arithmetic in TVM's Metal codegen

    def make_spec(self, dtype: str, sms: list[int] | None, cpu: str | None = None) -> TargetSpec:
        ld64 = find_ld64()
        if ld64:
            report = MetalBuildReport(host_format=HOST_FORMAT_DYLIB, linker=ld64_version(ld64))
        else:
            log.warning(
                "metal: ld64.lld not found (install Debian lld); the library ships as "
                "a .tar of objects that the Mac links with clang on first load"
            )
            report = MetalBuildReport(host_format=HOST_FORMAT_TAR, linker=NO_LINKER)
        return TargetSpec(
            self,
            tvm_target={"kind": "metal"},
            host={"kind": "llvm", "mtriple": "arm64-apple-macos"},
            report=report,
            platform="macos-arm64",
        )

    def library_stem(self, spec: TargetSpec) -> str:
        return "metal-arm64"

    def library_ext(self, spec: TargetSpec) -> str:
        return ".dylib" if spec.report.host_format == HOST_FORMAT_DYLIB else ".tar"

    def target_label(self, spec: TargetSpec) -> str:
        return "metal (Apple silicon)"

    def has_tensor_cores(self, target) -> bool:
        return True  # simdgroup matrices (Apple7+ GPUs)

    def build(self, mod, spec: TargetSpec, path: Path) -> None:
        import tvm

        target = spec.tvm()
        with target, self.pass_context(spec):
            executable = tvm.compile(mod, target, relax_pipeline=None)
        source = _shader_source(executable)
        spec.report.shaders = count(r"kernel void ", source)
        spec.report.tensor_core_in_source = "simdgroup_multiply_accumulate" in source
        simd = simdgroup_matrices(source)
        spec.report.tensor_core_kernels = sorted(simd)
        spec.report.simdgroup_matrices = simd
        if path.suffix == ".dylib":
            # The ld64 path was found when the spec was made; look again in case it went.
            ld64 = find_ld64()
            if ld64 is None:
                raise TargetError("ld64.lld disappeared during the compile; run it again")
            executable.export_library(str(path), fcompile=export_fcompile(ld64))
        else:
            executable.export_library(str(path))


_SHADER = re.compile(r"kernel void (\w+)\(")
_SIMD_DECL = re.compile(r"simdgroup_(\w+?)8x8 (\w+)\[")
_SIMD_MMA = re.compile(r"simdgroup_multiply_accumulate\((\w+)\[.*?\], (\w+)\[.*?\], (\w+)\[")


def simdgroup_matrices(source: str) -> dict[str, dict[str, list[str]]]:
    """{shader: {"accumulators": [...], "operands": [...]}} element types (`float`, `half`)
    of the simdgroup matrices each `simdgroup_multiply_accumulate` of a shader writes and
    reads, read from the generated Metal source: the evidence that a prefill matmul runs on
    simdgroup matrices, and at which precision it accumulates."""
    parts = _SHADER.split(source)
    found = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        types = {var: dtype for dtype, var in _SIMD_DECL.findall(body)}
        calls = _SIMD_MMA.findall(body)
        if calls:
            found[name] = {
                "accumulators": sorted({types.get(d, "?") for d, _, _ in calls}),
                "operands": sorted({types.get(v, "?") for _, a, b in calls for v in (a, b)}),
            }
    return found


def _shader_source(executable) -> str:
    """The Metal source of the shader module imported by the built library."""
    lib = executable.mod if hasattr(executable, "mod") else executable
    modules: dict = {}
    for m in lib.imports:
        for sub in (m, *m.imports):
            modules.setdefault(sub.kind, sub)
    shaders = modules.get("metal")
    return shaders.inspect_source() if shaders is not None else ""
