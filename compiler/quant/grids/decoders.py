"""The lattice i-quants' decoders, written once for numpy and for TIR.

Each decoder is `(r, j) -> float32 weight j of a block`, `r` a reader with `byte(offset)`
(an integer 0..255), `f16(bits)` (16 integer bits as a float32 value), `grid(i)` (byte
`i` of the format's grid table, `tables.grid_bytes`) and `f32(x)`. `numpy_codec` runs them
with `j` the vector of all positions and `byte` a column gather over many blocks;
`tir_decode` with TIR expressions. Only integer ops, `astype` and float `*`/`+` appear, so
one text serves both and the two decoders cannot drift apart.

Layouts (256 weights a block, offsets in bytes, little-endian; `d` an f16; a grid entry is
8 weights, 4 for IQ3; a sign index s (7 bits) gives sign bits s | parity(s) << 7):

========  ====  =====================================================================
type      size  fields                                    value
========  ====  =====================================================================
iq2_xxs   66    d@0; per 32 weights 8 bytes @2+8g: 4      d*(.5+s4)*.25*G[q]*sign
                grid bytes, u32 (4 x 7-bit signs, s4 top)
iq2_xs    74    d@0; u16 @2+2e (9-bit grid, 7-bit signs)   d*(.5+s)*.25*G[q]*sign
                per 8 weights; 4-bit scales @66 per 16
iq2_s     82    d@0; grid low @2+e, signs @34+e (8 bits),  d*(.5+s)*.25*G[q]*sign
                grid high 2 bits @66; 4-bit scales @74
iq3_xxs   98    d@0; grid @2+e (per 4 weights); u32 @66+4g  d*(.5+s4)*.5*G[q]*sign
                per 32 weights as iq2_xxs's
iq3_s     110   d@0; grid low @2+e, high bit @66, sign bit  d*(1+2s)*G[q]*sign
                per weight @74, 4-bit scales @106 per 32
iq1_s     50    d@0; grid low @2+e; u16 @34+2g per 32:      d*(2s+1)*(G[q]-1+-1/8)
                3 x 4 grid high bits, s (3 bits), sign of the delta (bit 15)
iq1_m     56    grid low @e; per 8 weights a nibble @32: 3  d*(2s+1)*(G[q]-1+-1/8)
                high bits + delta sign; 3-bit scales per 16 in 4 u16 @48, whose top
                nibbles are d's 16 bits
========  ====  =====================================================================

All bit-exact with `gguf.quants.dequantize`: every product is of an f16 and integers or
eighths of at most 7 bits, exact in float32 in any order.
"""

from __future__ import annotations

DELTA = 0.125  # IQ1's shift of the grid values


def _parity(s):
    p = s ^ (s >> 4)
    p = p ^ (p >> 2)
    return (p ^ (p >> 1)) & 1


def _signed(r, value, s, t):
    """value times the sign of position t (0..7) of 7-bit sign index s: bit t of s, the 8th
    the parity (an even number of minus signs)."""
    bit = ((s | (_parity(s) << 7)) >> t) & 1
    return value * r.f32(1 - 2 * bit)


def _half(r, off):
    return r.f16(r.byte(off) | (r.byte(off + 1) << 8))


def _u32(r, off):
    return r.byte(off) | (r.byte(off + 1) << 8) | (r.byte(off + 2) << 16) | (r.byte(off + 3) << 24)


def _xxs(r, j, grid_at, aux_at, per_entry, factor):
    """iq2_xxs and iq3_xxs: a u32 per 32 weights holds four 7-bit sign indices (one per 8
    weights) and a 4-bit scale in its top bits."""
    aux = _u32(r, aux_at)
    sub = j % 32 // 8
    db = _half(r, 0) * (0.5 + r.f32((aux >> 28) & 15)) * factor
    value = db * r.f32(r.grid(r.byte(grid_at) * per_entry + j % per_entry))
    return _signed(r, value, (aux >> (sub * 7)) & 127, j % 8)


def iq2_xxs(r, j):
    base = 2 + j // 32 * 8
    return _xxs(r, j, base + j % 32 // 8, base + 4, 8, 0.25)


def iq3_xxs(r, j):
    return _xxs(r, j, 2 + j // 4, 66 + j // 32 * 4, 4, 0.5)


def _scale16(r, off, j):
    """The 4-bit scale of weight j's 16 (iq2_xs, iq2_s): nibble (j // 16) % 2 of off + j // 32."""
    return (r.byte(off + j // 32) >> (j // 16 % 2 * 4)) & 15


def iq2_xs(r, j):
    e = j // 8
    q = r.byte(2 + 2 * e) | (r.byte(3 + 2 * e) << 8)
    db = _half(r, 0) * (0.5 + r.f32(_scale16(r, 66, j))) * 0.25
    value = db * r.f32(r.grid((q & 511) * 8 + j % 8))
    return _signed(r, value, q >> 9, j % 8)


def iq2_s(r, j):
    e = j // 8
    q = r.byte(2 + e) | (((r.byte(66 + e // 4) >> (e % 4 * 2)) & 3) << 8)
    db = _half(r, 0) * (0.5 + r.f32(_scale16(r, 74, j))) * 0.25
    value = db * r.f32(r.grid(q * 8 + j % 8))
    return value * r.f32(1 - 2 * ((r.byte(34 + e) >> (j % 8)) & 1))


def iq3_s(r, j):
    e = j // 4
    q = r.byte(2 + e) | (((r.byte(66 + e // 8) >> (e % 8)) & 1) << 8)
    scale = (r.byte(106 + j // 64) >> (j // 32 % 2 * 4)) & 15
    value = _half(r, 0) * r.f32(1 + 2 * scale) * r.f32(r.grid(q * 4 + j % 4))
    return value * r.f32(1 - 2 * ((r.byte(74 + j // 8) >> (j % 8)) & 1))


def _iq1(r, j, d, scale, grid_high, delta_sign, low_at):
    q = r.byte(low_at + j // 8) | (grid_high << 8)
    dl = d * r.f32(2 * scale + 1)
    shifted = r.f32(r.grid(q * 8 + j % 8) - 1) + DELTA * r.f32(1 - 2 * delta_sign)
    return dl * shifted


def iq1_s(r, j):
    at = 34 + j // 32 * 2
    qh = r.byte(at) | (r.byte(at + 1) << 8)
    high = (qh >> (j % 32 // 8 * 3)) & 7
    return _iq1(r, j, _half(r, 0), (qh >> 12) & 7, high, (qh >> 15) & 1, 2)


def iq1_m(r, j):
    e = j // 8
    nibble = (r.byte(32 + e // 2) >> (e % 2 * 4)) & 15
    s = j // 16
    word = r.byte(48 + s // 4 * 2) | (r.byte(49 + s // 4 * 2) << 8)
    # d's 16 bits: the top nibble of each of the four scale words, the first lowest
    bits = (
        (r.byte(49) >> 4)
        | ((r.byte(51) >> 4) << 4)
        | ((r.byte(53) >> 4) << 8)
        | ((r.byte(55) >> 4) << 12)
    )
    scale = (word >> (s % 4 * 3)) & 7
    return _iq1(r, j, r.f16(bits), scale, nibble & 7, nibble >> 3, 0)
