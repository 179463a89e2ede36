"""TIR decoders of the legacy formats: `(byte, j) -> float32` weight j of a 32-weight block.

Block layouts (offsets in bytes, little-endian, as llama.cpp's ``block_*`` structs):

====  ====  ===========================================================================
type  size  layout
====  ====  ===========================================================================
q8_0  34    d:f16 @0, qs:int8[32] @2                       w = d*q
q4_0  18    d @0, qs[16] @2 (lo nibble w[i], hi w[i+16])   w = d*(q-8)
q4_1  20    d @0, m @2, qs[16] @4                          w = d*q + m
q5_0  22    d @0, qh:u32 @2 (bit i = bit 4 of w[i]), qs @6 w = d*(q-16)
q5_1  24    d @0, m @2, qh @4, qs @8                       w = d*q + m
====  ====  ===========================================================================

Bit-exact with `gguf.quants.dequantize`: an f16 scale has 11 significant bits and the codes
at most 8, so every product is exact in float32; only the final add of the min rounds.
"""

from __future__ import annotations

from ..tir_bytes import bit, f32, half, signed, u32


def q8_0(byte, j):
    return half(byte, 0) * f32(signed(byte(2 + j)))


def nibble(byte, base, j):
    """Legacy 32-weight nibble packing: byte i holds weight i (low) and weight i + 16 (high)."""
    return (byte(base + j % 16) >> (j // 16 * 4)) & 15


def q4_0(byte, j):
    return half(byte, 0) * f32(nibble(byte, 2, j) - 8)


def q4_1(byte, j):
    return half(byte, 0) * f32(nibble(byte, 4, j)) + half(byte, 2)


# The fifth bits are read as one word shifted by j, not as byte j // 8 shifted by j % 8: the
# same word for every lane keeps a vectorised decode a vector shift (per-byte indexing made
# TVM fall back to scalar code, 5x slower).


def q5_0(byte, j):
    q = nibble(byte, 6, j) | (bit(u32(byte, 2), j) << 4)
    return half(byte, 0) * f32(q - 16)


def q5_1(byte, j):
    q = nibble(byte, 8, j) | (bit(u32(byte, 4), j) << 4)
    return half(byte, 0) * f32(q) + half(byte, 2)
