"""Legacy 32-weight block formats: q4_0, q4_1, q5_0, q5_1, q8_0.

Every function here works on a 2-D array of blocks: quantizers take ``[n_blocks, 32]`` float32
and return ``[n_blocks, type_size]`` uint8; dequantizers do the reverse.

Block layouts (little-endian, as llama.cpp's ``block_q*`` structs):

* q8_0: ``d:f16, qs:int8[32]``                      value = d * q
* q4_0: ``d:f16, qs:u8[16]``                        value = d * (q - 8)
* q4_1: ``d:f16, m:f16, qs:u8[16]``                 value = d * q + m
* q5_0: ``d:f16, qh:u32, qs:u8[16]``                value = d * (q - 16)
* q5_1: ``d:f16, m:f16, qh:u32, qs:u8[16]``         value = d * q + m

For the 4/5-bit types byte ``i`` of ``qs`` holds weight ``i`` in its low nibble and weight
``i + 16`` in its high nibble; bit ``i`` of ``qh`` is bit 4 of weight ``i``.

The arithmetic (float32 scale, float32 reciprocal, the rounding offsets) follows the reference
quantizers in ggml so that the bytes are identical to ``gguf.quants.quantize``.
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[n, 1] float32 -> [n, 2] uint8 holding the little-endian IEEE half."""
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(x.shape[0], 2)


def _f16_value(b: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n, 1] float32."""
    return np.ascontiguousarray(b).view("<f2").astype(_F32).reshape(b.shape[0], 1)


def _reciprocal(d: np.ndarray) -> np.ndarray:
    out = np.zeros_like(d)
    np.divide(_F32(1.0), d, out=out, where=d != 0)
    return out


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The element of largest magnitude in each row (first one on ties), keeping its sign."""
    idx = np.abs(x).argmax(axis=1)[:, None]
    return np.take_along_axis(x, idx, axis=1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 32] small ints -> [n, 16] bytes: low nibble weight i, high nibble weight i + 16."""
    q = q.astype(np.uint8)
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """[n, 32] 5-bit values -> [n, 4] bytes, a little-endian u32 with bit i = bit 4 of q[i]."""
    bits = (q.astype(np.uint8) >> 4) & 1
    return np.packbits(bits, axis=1, bitorder="little")


def _unpack_high_bits(qh: np.ndarray) -> np.ndarray:
    return np.unpackbits(qh, axis=1, bitorder="little")


def _trunc_to_codes(v: np.ndarray, top: int) -> np.ndarray:
    """ggml's ``(uint8)MIN(top, (int8)(v))`` for v >= 0: truncate then clamp."""
    return np.minimum(np.trunc(v), _F32(top)).astype(np.uint8)


# ----------------------------------------------------------------------------------------- q8_0


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=1, keepdims=True) / _F32(127)
    q = x * _reciprocal(d)
    # round half away from zero, computed without the float error of trunc(|q| + 0.5)
    a = np.abs(q)
    fl = np.floor(a)
    r = np.where(a - fl >= _F32(0.5), fl + _F32(1), fl)
    q = np.copysign(r, q).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), q], axis=1)


def dequantize_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16_value(b[:, 0:2])
    q = np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(_F32)
    return q * d


# ------------------------------------------------------------------------------- q4_0 and q5_0


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    d = _signed_absmax(x) / _F32(-8)
    q = _trunc_to_codes(x * _reciprocal(d) + _F32(8.5), 15)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=1)


def dequantize_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16_value(b[:, 0:2])
    q = _unpack_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return d * q.astype(_F32)


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    d = _signed_absmax(x) / _F32(-16)
    q = _trunc_to_codes(x * _reciprocal(d) + _F32(16.5), 31)
    return np.concatenate([_f16_bytes(d), _pack_high_bits(q), _pack_nibbles(q)], axis=1)


def dequantize_q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16_value(b[:, 0:2])
    q = _unpack_nibbles(b[:, 6:]) | (_unpack_high_bits(b[:, 2:6]) << 4)
    return d * (q.astype(np.int8) - np.int8(16)).astype(_F32)


# ------------------------------------------------------------------------------- q4_1 and q5_1


def _quantize_min_max(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lo = x.min(axis=1, keepdims=True)
    hi = x.max(axis=1, keepdims=True)
    d = (hi - lo) / _F32(top)
    q = _trunc_to_codes((x - lo) * _reciprocal(d) + _F32(0.5), top)
    return d, lo, q


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    d, lo, q = _quantize_min_max(x, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=1)


def dequantize_q4_1(b: np.ndarray) -> np.ndarray:
    d = _f16_value(b[:, 0:2])
    m = _f16_value(b[:, 2:4])
    q = _unpack_nibbles(b[:, 4:]).astype(_F32)
    return d * q + m


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    d, lo, q = _quantize_min_max(x, 31)
    parts = [_f16_bytes(d), _f16_bytes(lo), _pack_high_bits(q), _pack_nibbles(q)]
    return np.concatenate(parts, axis=1)


def dequantize_q5_1(b: np.ndarray) -> np.ndarray:
    d = _f16_value(b[:, 0:2])
    m = _f16_value(b[:, 2:4])
    q = _unpack_nibbles(b[:, 8:]) | (_unpack_high_bits(b[:, 4:8]) << 4)
    return d * q.astype(_F32) + m
