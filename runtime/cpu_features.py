"""The CPU features a library's code may use, named one way for the compiler and the runtime.

A CPU library records the features its code uses (the manifest's `cpu_features`, in Linux
/proc/cpuinfo spelling); at load the runtime compares them with the running CPU's and
refuses a library that needs more, instead of dying on an illegal instruction.

`FEATURES` maps each name we track to LLVM's name for it: the compiler asks LLVM which of them
a target has (`compiler/cpu_levels.py`), so the list follows the code actually generated for
`--cpu native` too. Only features that change the instructions LLVM may emit are listed.
"""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from pathlib import Path

# /proc/cpuinfo flag -> LLVM feature name, per machine architecture.
X86_FEATURES = {
    "ssse3": "ssse3",
    "sse4_1": "sse4.1",
    "sse4_2": "sse4.2",
    "popcnt": "popcnt",
    "cx16": "cx16",
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "bmi1": "bmi",
    "bmi2": "bmi2",
    "abm": "lzcnt",  # the kernel names LZCNT "abm"
    "movbe": "movbe",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512cd": "avx512cd",
    "avx512dq": "avx512dq",
    "avx512vl": "avx512vl",
    "avx512_vnni": "avx512vnni",
    "avx512_bf16": "avx512bf16",
    "avx512vbmi": "avx512vbmi",
    "avx_vnni": "avxvnni",
    "amx_tile": "amx-tile",
    "amx_bf16": "amx-bf16",
}
ARM_FEATURES = {
    "asimd": "neon",
    "asimdhp": "fullfp16",
    "asimddp": "dotprod",
    "i8mm": "i8mm",
    "bf16": "bf16",
    "sve": "sve",
}
FEATURES = {"x86_64": X86_FEATURES, "arm64": ARM_FEATURES}

# macOS reports arm64 features as sysctl hw.optional.* keys.
_MAC_ARM_KEYS = {
    "hw.optional.neon": "asimd",
    "hw.optional.arm.FEAT_FP16": "asimdhp",
    "hw.optional.arm.FEAT_DotProd": "asimddp",
    "hw.optional.arm.FEAT_I8MM": "i8mm",
    "hw.optional.arm.FEAT_BF16": "bf16",
}
# ...and x86 features as words of machdep.cpu.{features,leaf7_features} (upper case).
_MAC_X86_NAMES = {"avx1.0": "avx", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "lzcnt": "abm"}
_MAC_X86_NAMES.update({"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16"})


def host_machine() -> str:
    """This machine's architecture as the manifest names it: `x86_64` or `arm64`."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "aarch64": "arm64"}.get(machine, machine)


def host_os() -> str:
    return {"darwin": "macos"}.get(
        sys.platform, "linux" if sys.platform.startswith("linux") else sys.platform
    )


def host_platform() -> str:
    """`<os>-<machine>` of the running machine, e.g. `linux-x86_64`, `macos-arm64`."""
    return f"{host_os()}-{host_machine()}"


def parse_cpuinfo(text: str) -> frozenset[str]:
    """The feature flags of /proc/cpuinfo (`flags` on x86, `Features` on arm64), first CPU."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _mac_features() -> frozenset[str]:
    def sysctl(*keys: str) -> list[str]:
        proc = subprocess.run(["sysctl", *keys], capture_output=True, text=True, check=False)
        return proc.stdout.splitlines()

    found: set[str] = set()
    if host_machine() == "arm64":
        for line in sysctl(*_MAC_ARM_KEYS):
            key, _, value = line.partition(":")
            if value.strip() == "1" and key.strip() in _MAC_ARM_KEYS:
                found.add(_MAC_ARM_KEYS[key.strip()])
        return frozenset(found | {"asimd"})  # every arm64 Mac has Advanced SIMD
    for line in sysctl("machdep.cpu.features", "machdep.cpu.leaf7_features"):
        for word in line.partition(":")[2].split():
            name = word.lower()
            found.add(_MAC_X86_NAMES.get(name, name))
    return frozenset(found)


def host_features() -> frozenset[str]:
    """The running CPU's features, in /proc/cpuinfo spelling (empty when unknown).

    AMX counts only once Linux has given this process its tile state
    (`request_amx_tiles`): a CPU that has AMX but a kernel that refuses it runs no AMX
    library, so such a library is refused at load, not by an illegal instruction."""
    if host_os() == "macos":
        return _mac_features()
    try:
        flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()
    if "amx_tile" in flags and not request_amx_tiles():
        flags = frozenset(f for f in flags if not f.startswith("amx_"))
    return flags


_ARCH_REQ_XCOMP_PERM = 0x1023  # arch_prctl: ask for an extended state component
_XFEATURE_XTILEDATA = 18  # the AMX tile data
_SYS_ARCH_PRCTL = 158  # x86-64


@functools.cache
def request_amx_tiles() -> bool:
    """Ask Linux for the AMX tile state for this process (every thread, from then on);
    whether it was given. Linux (5.16 on) starts a process without it, and a tile
    instruction before the request dies with SIGILL."""
    if host_os() != "linux" or host_machine() != "x86_64":
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
