"""TIR helpers shared by the formats' byte decoders (`<family>/tir_decode.py`).

A decoder reads its block through `byte(offset_in_block)`, an int32 expression 0..255, so
the same expression serves the full-matrix dequantization, the fused matmul and the
embedding lookup (see `model_defs.quant_ops.dequant_value`). int32 lane arithmetic: with
int64 (the index type nn uses) the vectorised shifts and masks would run on half-width
vectors.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx

Byte = Callable  # offset in block -> int32 value 0..255


def f32(v):
    return v.astype("float32")


def half(byte: Byte, off: int):
    """IEEE half at `off` -> float32 (reinterpret the u16 bits, widen exactly)."""
    bits = (byte(off) | (byte(off + 1) << 8)).astype("uint16")
    return tirx.reinterpret("float16", bits).astype("float32")


def signed(b):
    """A byte 0..255 read as int8, in int32."""
    return b - ((b >> 7) << 8)


def bit(b, shift):
    return (b >> shift) & 1


def u32(byte: Byte, off):
    """The little-endian 32-bit word at `off` (as int32: bit 31 lands in the sign)."""
    return byte(off) | (byte(off + 1) << 8) | (byte(off + 2) << 16) | (byte(off + 3) << 24)


def small_table(values) -> Callable:
    """`q -> values[q]` as int32 TIR arithmetic on constants, for 16 integers spanning at
    most 255 (the i-quants' and MXFP4's non-linear tables).

    No constant buffer nor a chain of 15 selects: the entries minus the smallest are bytes,
    four to an int32 word; two selects on bits 2 and 3 of the index pick the word (a binary
    tree of 3), a shift by 8 times bits 0-1 the byte. The same expression must serve the
    CPU's vectorised loops (a select is a blend there, a per-lane variable shift one AVX2
    instruction) and the GPU schedules (ternaries and shifts in registers): a constant
    buffer would need a parameter or an allocation in every kernel that decodes weights,
    and the 15-select chain costs five times the selects.
    """
    values = [int(v) for v in values]
    low = min(values)
    if len(values) != 16 or max(values) - low > 255:
        raise ValueError("small_table takes 16 values spanning at most 255")
    words = []
    for k in range(4):
        w = sum((v - low) << (8 * i) for i, v in enumerate(values[4 * k : 4 * k + 4]))
        words.append(w - (1 << 32) if w >= 1 << 31 else w)

    def lookup(q):
        # int32 whatever the index's type: the GPU schedules can hand an int64 index here,
        # and OpenCL cannot convert the int64 vector comparisons of its selects (PoCL)
        q = tirx.const(q, "int32") if isinstance(q, int) else q.astype("int32")
        w = [tirx.const(v, "int32") for v in words]
        upper = (q & 4) != 0
        pick = tirx.Select
        word = pick((q & 8) != 0, pick(upper, w[3], w[2]), pick(upper, w[1], w[0]))
        # (an arithmetic shift: bits shifted in from a negative word are masked away)
        return ((word >> ((q & 3) << 3)) & 255) + low

    return lookup
