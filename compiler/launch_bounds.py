"""Spill repair for CUDA kernels: give ptxas the occupancy target it chose, explicitly.

TVM writes `__launch_bounds__(threads)` on every kernel, without the second argument
(minimum resident blocks per SM). Given only the thread count, ptxas 13.0 picks a register
budget by its own occupancy heuristic, and for some kernels it then spills although more
registers were allowed. Seen for TVM's paged-attention prefill kernels (128 threads): at
sm_90 `batch_prefill_paged_kv` used 64 registers and spilled 20 bytes (stores; 48 loads);
the same source with `__launch_bounds__(128, 8)`, i.e. the same 64-register budget stated
as 8 blocks per SM, compiles to 64 registers and no spills; `(128, 7)` gives 72 registers,
no spills at sm_80 and sm_90. (`-Xptxas --register-usage-level=0` also avoids it, but that
option is documented as beta and changes every kernel.)

So after the first nvcc run, every kernel that spilled on any arch is recompiled with
`__launch_bounds__(threads, blocks)`, where `blocks` is the most blocks per SM that still
allow the registers ptxas used on every arch (65536 registers per SM on sm_70 to sm_90):
the kernel keeps at least its register budget and its occupancy, and ptxas is told so.
Kernels that did not spill are left byte-for-byte alone. A kernel that still spills after
this (a register demand above the 65536 / threads cap) stays in the report: the fix for
those is a schedule with fewer threads or fewer live values, not a compiler flag.
"""

from __future__ import annotations

import re

REGISTERS_PER_SM = 65536  # sm_70 .. sm_90 (CUDA occupancy tables)

_BOUNDED_KERNEL = re.compile(r"__launch_bounds__\((\d+)\) (\w+)\(")


def spilling(resources: dict[str, dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """{kernel: {arch: spill-store bytes}} of the kernels that spill on some arch."""
    return {
        kernel: {arch: r.get("spill_stores", 0) for arch, r in per_arch.items()}
        for kernel, per_arch in resources.items()
        if any(r.get("spill_stores") or r.get("spill_loads") for r in per_arch.values())
    }


def min_blocks(
    source: str, resources: dict[str, dict[str, dict[str, int]]], kernels
) -> dict[str, tuple[int, int]]:
    """{kernel: (threads, minimum blocks per SM)} keeping each kernel's registers on every
    arch."""
    threads = {name: int(n) for n, name in _BOUNDED_KERNEL.findall(source)}
    out = {}
    for kernel in kernels:
        if kernel not in threads:
            continue  # no launch bounds written: nothing to state
        most = max(r.get("registers", 0) for r in resources[kernel].values())
        n = threads[kernel]
        out[kernel] = (n, max(1, REGISTERS_PER_SM // (n * max(most, 1))))
    return out


def with_min_blocks(source: str, blocks: dict[str, int]) -> str:
    """`source` with `__launch_bounds__(threads, blocks)` on the named kernels (declarations
    and definitions alike); other kernels unchanged."""

    def bound(m: re.Match) -> str:
        n, name = m.group(1), m.group(2)
        if name not in blocks:
            return m.group(0)
        return f"__launch_bounds__({n}, {blocks[name]}) {name}("

    return _BOUNDED_KERNEL.sub(bound, source)
