"""Compile targets: what the user names (`cpu`, `cuda`, `metal`), what TVM needs, and which
dtypes run there.

CUDA: one library may carry SASS for several architectures (`--sm 80 --sm 90`). TIR is
scheduled once, for the lowest requested arch (its features are a subset of the others'),
and `compiler/cuda_build.py` compiles that code for every arch into one fatbin.
Metal: the host code is arm64 macOS; it is exported as a .tar of objects because this
(Linux) machine cannot link a macOS dylib; see docs/metal.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tallow.runtime.errors import TargetError

DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


@dataclass
class TargetSpec:
    kind: str  # "cpu" | "cuda" | "metal"
    tvm_target: dict[str, Any]
    host: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def tvm(self):
        import tvm

        if self.host is None:
            return tvm.target.Target(self.tvm_target)
        return tvm.target.Target(self.tvm_target, host=self.host)

    @property
    def suffix(self) -> str:
        if self.kind == "cuda":
            return "cuda-" + "-".join(self.details["archs"])
        return self.kind

    @property
    def library_name(self) -> str:
        # A macOS dylib cannot be linked here: Metal artifacts ship objects (docs/metal.md).
        return "model.tar" if self.kind == "metal" else "model.so"

    @property
    def sms(self) -> list[int]:
        return [int(a[3:]) for a in self.details.get("archs", [])]


def _host_cpu() -> str:
    import tvm

    get = tvm.get_global_func("target.llvm_get_system_cpu", allow_missing=True)
    return str(get()) if get is not None else "generic"


# Architectures we build and test for (Ampere, Ampere GA10x, Ada, Hopper, Blackwell DC/RTX).
CUDA_SMS = (80, 86, 89, 90, 100, 120)


def _cuda_target(dtype: str, sms: list[int] | None) -> TargetSpec:
    sms = sorted(set(sms or [90]))
    bad = [sm for sm in sms if sm not in CUDA_SMS]
    if bad:
        raise TargetError(
            f"--sm {', '.join(map(str, bad))} is not supported; choose from "
            f"{', '.join(map(str, CUDA_SMS))}"
        )
    if dtype == "bf16" and sms[0] < 80:  # unreachable with CUDA_SMS today; kept as the rule
        raise TargetError(f"bf16 needs sm_80 or newer; sm_{sms[0]} has no bf16 arithmetic")
    archs = [f"sm_{sm}" for sm in sms]
    return TargetSpec(
        kind="cuda",
        # 48 KiB is the shared memory every arch gives a block without an opt-in; stating it
        # keeps dlight from guessing (it assumes the same value, with a warning per kernel).
        tvm_target={
            "kind": "cuda",
            "arch": archs[0],
            "max_shared_memory_per_block": 49152,
            "max_threads_per_block": 1024,
            "thread_warp_size": 32,
        },
        host={"kind": "llvm"},  # generic x86-64 host code: runs on any GPU server's CPU
        details={"archs": archs, "scheduled_for": archs[0]},
    )


def _metal_target(dtype: str) -> TargetSpec:
    if dtype == "bf16":
        raise TargetError("bf16 is not supported on metal; use --dtype f16 or f32")
    return TargetSpec(
        kind="metal",
        tvm_target={"kind": "metal"},
        host={"kind": "llvm", "mtriple": "arm64-apple-macos"},
        details={"host_format": "tar of arm64 Mach-O objects, linked on the Mac at load"},
    )


def resolve_target(kind: str, dtype: str, sms: list[int] | None = None) -> TargetSpec:
    if dtype not in DTYPES:
        raise TargetError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if sms and kind != "cuda":
        raise TargetError("--sm applies to --target cuda only")
    if kind == "cuda":
        return _cuda_target(dtype, sms)
    if kind == "metal":
        return _metal_target(dtype)
    if kind != "cpu":
        raise TargetError(f"target {kind!r} is not supported; supported: cpu, cuda, metal")
    cpu = _host_cpu()
    tvm_target = {"kind": "llvm", "mcpu": cpu}
    if _has_sse4a(cpu):
        # AMD's SSE4a `insertq`, which LLVM picks to build a vector from 16-bit loads, is
        # legacy-encoded: between AVX instructions it stalled the column decode kernel
        # (q4_0, 16 sequences: 1.30 ms with it, 0.45 ms without).
        tvm_target["mattr"] = ["-sse4a"]
    return TargetSpec(kind="cpu", tvm_target=tvm_target, details={"mcpu": cpu})


def _has_sse4a(cpu: str) -> bool:
    from tvm.target import Target, codegen

    try:
        return bool(codegen.target_has_features("sse4a", Target({"kind": "llvm", "mcpu": cpu})))
    except Exception:  # noqa: BLE001 - an LLVM without x86 support has no such feature
        return False
