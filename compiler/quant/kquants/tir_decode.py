"""TIR decoders of the K-quants: `(byte, j) -> float32` weight j of a 256-weight super-block.

Block layouts (offsets in bytes, little-endian, as llama.cpp's ``block_*_K`` structs):

====  ====  ===========================================================================
type  size  layout
====  ====  ===========================================================================
q2k   84    scales[16] @0 (lo: scale, hi: min), qs[64] @16, d @80, dmin @82
q3k   110   hmask[32] @0, qs[64] @32, scales (16 x 6 bit)[12] @96, d @108
q4k   144   d @0, dmin @2, scales (8+8 x 6 bit)[12] @4, qs[128] @16
q5k   176   d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48
q6k   210   ql[128] @0, qh[64] @128, scales:int8[16] @192, d @208
====  ====  ===========================================================================

Bit-exact with `gguf.quants.dequantize`: an f16 scale has 11 significant bits and the codes
and sub-scales at most 6 bits each, so every product is exact in float32; only the final
subtraction of the min rounds (so neither the order of the multiplications nor LLVM's FMA
contraction changes the result).
"""

from __future__ import annotations

from ..tir_bytes import bit, f32, half, signed


def q2k(byte, j):
    # 2-bit codes: byte 16 + 32*(j//128) + j%32, bit pair (j%128)//32; scale/min per 16.
    sc = byte(j // 16)
    q = (byte(16 + j // 128 * 32 + j % 32) >> (j % 128 // 32 * 2)) & 3
    dl = half(byte, 80) * f32(sc & 15)
    return dl * f32(q) - half(byte, 82) * f32(sc >> 4)


def q3k(byte, j):
    s = j // 16
    lo = (byte(96 + s % 8) >> (s // 8 * 4)) & 15
    hi = (byte(104 + s % 4) >> (s // 4 * 2)) & 3
    scale = (lo | (hi << 4)) - 32
    ql = (byte(32 + j // 128 * 32 + j % 32) >> (j % 128 // 32 * 2)) & 3
    # a clear hmask bit subtracts 4 (llama.cpp's "offset is zero when the bit is set")
    hbit = bit(byte(j % 32), j // 128 * 4 + j % 128 // 32)
    q = ql - ((1 - hbit) << 2)
    return half(byte, 108) * f32(scale) * f32(q)


def k4_scale_min(byte, sb):
    """llama.cpp's get_scale_min_k4 for sub-block sb (0..7), scales at bytes 4..15 (q4k, q5k;
    also the int8 groups' scales, so the two decoders cannot drift apart).

    Sub-blocks 0-3 keep 6 bits in one byte; 4-7 take 4 low bits from bytes 12..15 and 2 high
    bits from the top of bytes 4..11. Written without a select, as offsets and shifts that
    depend on `lo` (1 for sub-blocks 0-3): a select on the sub-block stayed a per-lane
    blend in the vectorised decode (3x the work of q4_1 per weight).
    """
    lo = 1 - sb // 4
    high_shift = 6 - 2 * lo  # the 2 high bits: bits 4-5 of one byte, or 6-7 of another
    sc = (byte(8 + sb - 4 * lo) & 15) | (((byte(sb + 4 * lo) >> high_shift) & 3) << 4)
    mn = ((byte(8 + sb) >> (4 - 4 * lo)) & 15) | (((byte(4 + sb + 4 * lo) >> high_shift) & 3) << 4)
    return sc, mn


def k4_codes(byte, base, j):
    """K-quant 4-bit codes: 64-weight chunks of 32 bytes, low nibbles first then high."""
    return (byte(base + j // 64 * 32 + j % 32) >> (j % 64 // 32 * 4)) & 15


def q4k(byte, j):
    sc, mn = k4_scale_min(byte, j // 32)
    q = k4_codes(byte, 16, j)
    return half(byte, 0) * f32(sc) * f32(q) - half(byte, 2) * f32(mn)


def q5k(byte, j):
    sc, mn = k4_scale_min(byte, j // 32)
    q = k4_codes(byte, 48, j) | (bit(byte(16 + j % 32), j // 32) << 4)
    return half(byte, 0) * f32(sc) * f32(q) - half(byte, 2) * f32(mn)


def q6k(byte, j):
    n, g, lane = j // 128, j % 128 // 32, j % 32
    ql = (byte(n * 64 + g % 2 * 32 + lane) >> (g // 2 * 4)) & 15
    qh = (byte(128 + n * 32 + lane) >> (g * 2)) & 3
    q = (ql | (qh << 4)) - 32
    return half(byte, 208) * f32(signed(byte(192 + j // 16))) * f32(q)
