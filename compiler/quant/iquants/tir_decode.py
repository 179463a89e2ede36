"""TIR decoders of the i-quants: `(byte, j) -> float32` weight j of a block.

Block layouts (offsets in bytes, little-endian; see `numpy_codec` for the fields):

======  ====  =========================================================================
type    size  layout
======  ====  =========================================================================
iq4_nl  18    d:f16 @0, qs[16] @2 (lo nibble w[i], hi w[i+16])      w = d*T[q]
iq4_xs  136   d @0, scales_h:u16 @2, scales_l[4] @4, qs[128] @8     w = d*(ls-32)*T[q]
======  ====  =========================================================================

The table lookup `T[q]` is arithmetic on constants, not a constant buffer nor a chain of 15
selects: the 16 entries plus 127 are bytes (0..240), four to an int32 word; two selects on
bits 2 and 3 of the index pick the word (a binary tree of 3), a shift by 8 times bits 0-1
the byte. A decoder only sees `byte(offset)` expressions, and the same expression must serve
the CPU's vectorised loops (a select is a blend there, a per-lane variable shift one AVX2
instruction) and the GPU schedules (ternaries and shifts in registers): a constant buffer
would need a parameter or an allocation in every kernel that decodes weights, and the
15-select chain costs five times the selects.

Bit-exact with `gguf.quants.dequantize`: f16 (11 bits) times ls - 32 (6 bits) times T
(7 bits) is exact in float32, in any order.
"""

from __future__ import annotations

from tvm import tirx

from ..tir_bytes import f32, half
from .numpy_codec import TABLE, XS_MAX_SCALE


def _table_words() -> list[int]:
    """TABLE + 127 as bytes, four to a little-endian word, as signed int32 constants."""
    biased = [int(v) + 127 for v in TABLE]
    words = []
    for k in range(4):
        w = sum(b << (8 * i) for i, b in enumerate(biased[4 * k : 4 * k + 4]))
        words.append(w - (1 << 32) if w >= 1 << 31 else w)
    return words


_WORDS = _table_words()


def table_value(q):
    """T[q] as an int32 expression, for an int32 expression q in 0..15."""
    w = [tirx.const(v, "int32") for v in _WORDS]
    upper = (q & 4) != 0
    word = tirx.Select((q & 8) != 0, tirx.Select(upper, w[3], w[2]), tirx.Select(upper, w[1], w[0]))
    # (an arithmetic shift: bits shifted in from a negative word are masked away)
    return ((word >> ((q & 3) << 3)) & 255) - 127


def nibble(byte, base, j):
    """Byte base + j % 16 holds weight j % 16 of a 32-weight group (low nibble) and weight
    j % 16 + 16 (high): the legacy packing."""
    return (byte(base + j % 16) >> (j % 32 // 16 * 4)) & 15


def iq4_nl(byte, j):
    return half(byte, 0) * f32(table_value(nibble(byte, 2, j)))


def xs_group_scale(byte, g):
    """ls - 32 of iq4_xs group g (0..7): 4 bits from scales_l, 2 from scales_h (also the
    int8 groups' scale, so the two decoders cannot drift apart)."""
    low = (byte(4 + g // 2) >> (g % 2 * 4)) & 15
    high = (byte(2 + g // 4) >> (g % 4 * 2)) & 3
    return (low | (high << 4)) - XS_MAX_SCALE


def iq4_xs(byte, j):
    g = j // 32
    q = nibble(byte, 8 + g * 16, j)
    return half(byte, 0) * f32(xs_group_scale(byte, g)) * f32(table_value(q))
