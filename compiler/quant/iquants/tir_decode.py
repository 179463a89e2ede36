"""TIR decoders of the i-quants: `(byte, j) -> float32` weight j of a block.

Block layouts (offsets in bytes, little-endian; see `numpy_codec` for the fields):

======  ====  =========================================================================
type    size  layout
======  ====  =========================================================================
iq4_nl  18    d:f16 @0, qs[16] @2 (lo nibble w[i], hi w[i+16])      w = d*T[q]
iq4_xs  136   d @0, scales_h:u16 @2, scales_l[4] @4, qs[128] @8     w = d*(ls-32)*T[q]
======  ====  =========================================================================

The table lookup `T[q]` is arithmetic on constants (`tir_bytes.small_table`, which says
why).

Bit-exact with `gguf.quants.dequantize`: f16 (11 bits) times ls - 32 (6 bits) times T
(7 bits) is exact in float32, in any order.
"""

from __future__ import annotations

from ..tir_bytes import f32, half, small_table
from .numpy_codec import TABLE, XS_MAX_SCALE

table_value = small_table(TABLE)  # T[q] as an int32 expression, q an int32 0..15


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
