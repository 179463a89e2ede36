"""`--cpu LEVEL`: which CPUs a CPU library runs on.

`native` (the default) tunes for the compiling machine's CPU and uses everything it has;
a named level is a fixed instruction set, so a library built by a CI runner runs on every
CPU of that level. The schedules read the level through the TVM target's features
(`codegen.target_has_features`), never the build host's, so an `x86-64-v3` library holds no
AVX-512 instruction even when built on an AVX-512 machine.

The library records the CPU features its code may use (`required_features`, asked of LLVM
for the target itself), which the runtime checks against the running CPU before loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tallow.runtime.cpu_features import FEATURES, host_platform
from tallow.runtime.errors import TargetError

_X86 = {"kind": "llvm", "mtriple": "x86_64-linux-gnu"}


@dataclass(frozen=True)
class CPULevel:
    name: str
    tvm_target: dict[str, Any]
    platform: str  # where the library runs (`cpu_features.host_platform()` spelling)
    linked_here: bool  # False: shipped as a .tar of objects, linked on the running machine
    about: str  # one line for --help and the docs


LEVELS = {
    level.name: level
    for level in (
        CPULevel(
            "x86-64-v2",
            {**_X86, "mcpu": "x86-64-v2"},
            "linux-x86_64",
            True,
            "SSE4.2, POPCNT (x86 CPUs since about 2009)",
        ),
        CPULevel(
            "x86-64-v3",
            {**_X86, "mcpu": "x86-64-v3"},
            "linux-x86_64",
            True,
            "AVX2, FMA, BMI2 (Haswell, Zen 1 and newer)",
        ),
        CPULevel(
            "x86-64-v4",
            {**_X86, "mcpu": "x86-64-v4"},
            "linux-x86_64",
            True,
            "AVX-512 F/BW/CD/DQ/VL (Skylake-SP, Zen 4 and newer)",
        ),
        CPULevel(
            "x86-64-v4-vnni",
            {**_X86, "mcpu": "x86-64-v4", "mattr": ["+avx512vnni"]},
            "linux-x86_64",
            True,
            "x86-64-v4 plus AVX-512 VNNI int8 dot products (Ice Lake, Zen 4 and newer)",
        ),
        CPULevel(
            "x86-64-v4-amx",
            {
                **_X86,
                "mcpu": "x86-64-v4",
                "mattr": ["+avx512vnni", "+avx512bf16", "+amx-tile", "+amx-int8", "+amx-bf16"],
            },
            "linux-x86_64",
            True,
            "x86-64-v4-vnni plus AMX tiles and bf16 (Sapphire Rapids and newer Xeons): prefill "
            "on AMX",
        ),
        CPULevel(
            "arm64",
            {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "generic", "mattr": ["+neon"]},
            "linux-arm64",
            False,
            "64-bit Arm Linux with NEON (Graviton, Ampere, Raspberry Pi 4+)",
        ),
        CPULevel(
            "apple-m1",
            {"kind": "llvm", "mtriple": "arm64-apple-macos", "mcpu": "apple-m1"},
            "macos-arm64",
            False,
            "Apple silicon Macs (M1 and newer)",
        ),
    )
}
CPU_CHOICES = ("native", *LEVELS)


def resolve_level(name: str | None) -> CPULevel:
    """The level for `--cpu name` (None: native)."""
    name = name or "native"
    if name == "native":
        return _native()
    try:
        return LEVELS[name]
    except KeyError:
        raise TargetError(
            f"--cpu {name!r} is not a CPU level; choose from {', '.join(CPU_CHOICES)}"
        ) from None


def _native() -> CPULevel:
    cpu = host_cpu()
    tvm_target: dict[str, Any] = {"kind": "llvm", "mcpu": cpu}
    if _has_feature(tvm_target, "sse4a"):
        # AMD's SSE4a `insertq`, which LLVM picks to build a vector from 16-bit loads, is
        # legacy-encoded: between AVX instructions it stalled the column decode kernel
        # (q4_0, 16 sequences: 1.30 ms with it, 0.45 ms without).
        tvm_target["mattr"] = ["-sse4a"]
    return CPULevel("native", tvm_target, host_platform(), True, f"this machine's CPU ({cpu})")


def required_features(tvm_target: dict[str, Any], platform: str) -> list[str]:
    """The tracked CPU features (/proc/cpuinfo names) LLVM may use for `tvm_target`."""
    machine = platform.partition("-")[2]
    table = FEATURES.get(machine, {})
    return [name for name, llvm in table.items() if _has_feature(tvm_target, llvm)]


def host_cpu() -> str:
    import tvm

    get = tvm.get_global_func("target.llvm_get_system_cpu", allow_missing=True)
    return str(get()) if get is not None else "generic"


def _has_feature(tvm_target: dict[str, Any], feature: str) -> bool:
    from tvm.target import Target, codegen

    try:
        return bool(codegen.target_has_features(feature, Target(tvm_target)))
    except Exception:  # noqa: BLE001 - an LLVM without this architecture has no such feature
        return False
