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
