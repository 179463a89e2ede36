"""Small helpers for hand-written TIR over explicit vectors (lanes as one value).

TVM 0.27's expressions do not expose a dtype from Python, so the lane counts are passed in.
"""

from __future__ import annotations

from tvm import tirx


def lanes(vec, idx):
    """The lanes `idx` of `vec`, in that order (a shuffle)."""
    return tirx.Shuffle([vec], [tirx.const(i, "int32") for i in idx])


def reduce_lanes(vec, count: int, combine):
    """Combine the `count` lanes of `vec` pairwise down to one scalar (log2(count) steps)."""
    while count > 1:
        count //= 2
        vec = combine(lanes(vec, range(count)), lanes(vec, range(count, 2 * count)))
    return vec


def add(a, b):
    return a + b


def maximum(a, b):
    return tirx.max(a, b)


def minimum(a, b):
    return tirx.min(a, b)


def _pair_sums(a, b):
    """Adjacent lanes of `a` and `b` (8 lanes each) added, within each half of 4 lanes:
    [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] (x86: one `vhaddps`)."""
    even = tirx.Shuffle([a, b], [tirx.const(i, "int32") for i in (0, 2, 8, 10, 4, 6, 12, 14)])
    odd = tirx.Shuffle([a, b], [tirx.const(i, "int32") for i in (1, 3, 9, 11, 5, 7, 13, 15)])
    return even + odd


def row_sums(buf, base):
    """One vector of 8 lanes: lane i is the sum of the 8 float32 lanes at
    buf[base + 8 * i : base + 8 * (i + 1)], for i in 0..7 (a transpose and add of 8 vectors)."""
    rows = [buf.vload([base + 8 * i], "float32x8") for i in range(8)]
    # [r0 (0-3), r1 (0-3), r2 (0-3), r3 (0-3), r0 (4-7), r1 (4-7), ...] and the same for r4-r7
    low = _pair_sums(_pair_sums(rows[0], rows[1]), _pair_sums(rows[2], rows[3]))
    high = _pair_sums(_pair_sums(rows[4], rows[5]), _pair_sums(rows[6], rows[7]))
    halves = [tirx.const(i, "int32") for i in (0, 1, 2, 3, 8, 9, 10, 11)]
    other = [tirx.const(i, "int32") for i in (4, 5, 6, 7, 12, 13, 14, 15)]
    return tirx.Shuffle([low, high], halves) + tirx.Shuffle([low, high], other)


def prefetch(address):
    """Ask the CPU to bring the cache line at `address` (a `tirx.address_of`) into all cache
    levels, for memory the hardware prefetchers would not predict. Never faults."""
    return tirx.call_llvm_intrin(
        "void",
        "llvm.prefetch.p0",
        address,
        tirx.const(0, "int32"),  # a read
        tirx.const(3, "int32"),  # keep in every level
        tirx.const(1, "int32"),  # data, not instructions
    )
