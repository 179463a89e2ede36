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
