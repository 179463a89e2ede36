"""The ternary formats TQ1_0 / TQ2_0 and the microscaling MXFP4 in numpy: decoders and
quantizers. None of them needs a lookup grid or an importance matrix.

Layouts (little-endian; ``d`` an f16 scale stored *after* the codes in both TQ types):

* tq2_0 (GGML type 35, 256 weights, 66 bytes): ``qs:u8[64], d:f16``. Weight ``j`` is the
  2-bit field ``(j % 128) // 32`` (bits ``2k, 2k + 1``) of byte ``j // 128 * 32 + j % 32``;
  value ``d * (q - 1)``, ``q`` in 0..2 (3 is never written; it decodes to ``2d``).
* tq1_0 (GGML type 34, 256 weights, 54 bytes): ``qs:u8[48], qh:u8[4], d:f16``. A byte holds
  up to five base-3 digits as a fixed-point fraction: digit ``k`` is
  ``((byte * 3**k) mod 256) * 3 >> 8``, so reading digit ``k`` is a multiply and a shift, no
  division. Weights 0..159: byte ``j % 32`` digit ``j // 32``; 160..239: byte ``32 + j % 16``
  digit ``(j - 160) // 16``; 240..255: byte ``48 + j % 4`` of qh, digit ``(j - 240) // 4``.
  The value is ``d * (digit - 1)``.
* mxfp4 (GGML type 39, 32 weights, 17 bytes): ``e:u8, qs:u8[16]`` (OCP microscaling: an
  E8M0 shared exponent, 32 FP4 E2M1 values packed as the legacy nibbles, byte ``i`` weight
  ``i`` low, ``i + 16`` high). ggml stores the E2M1 values doubled (``E2M1_X2``: integers)
  and the scale halved: value ``2**(e - 128) * E2M1_X2[q]``, for every ``e`` 0..255 (e 0
  and 1 give the float32 subnormals 2**-128, 2**-127).

Every decoder is bit-exact with ``gguf.quants.dequantize`` (a power of two or an f16 times
an integer of at most 4 bits is exact in float32). The quantizers are the natural ones and
match ``gguf.quants.quantize`` byte for byte on data away from ties: TQ takes the block's
largest magnitude as ``d`` and rounds ``x / d`` to -1, 0, 1 (half away from zero); MXFP4
takes the exponent that puts the block's largest magnitude in E2M1's top binade (4..8 in
doubled units, so values up to 6 * 2 = 12 times the scale fit) and each weight's nearest
E2M1 value (the first in table order on a tie, as gguf's).
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32

TQ_BLOCK = 256
# E2M1 values times two, index = the 4-bit code (bit 3 the sign): the OCP MX spec's table
E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
_E2M1 = E2M1_X2.astype(_F32)
# TQ1_0: the digit k of each weight (0..255) and the byte it lives in
_TQ1_DIGIT = np.concatenate([np.arange(160) // 32, np.arange(80) // 16, np.arange(16) // 4]).astype(
    np.uint8
)
_TQ1_BYTE = np.concatenate([np.arange(160) % 32, 32 + np.arange(80) % 16, 48 + np.arange(16) % 4])
_POW3 = np.array([1, 3, 9, 27, 81], np.uint8)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(x.shape[0], 2)


def _f16_value(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").astype(_F32).reshape(b.shape[0], 1)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    return np.trunc(v + np.copysign(_F32(0.5), v))


def _ternary(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(f16 bytes of d [n, 2], codes 0..2 [n, 256]) of blocks x: d the largest magnitude."""
    d = np.abs(x).max(axis=1, keepdims=True)
    inv = np.zeros_like(d)
    np.divide(_F32(1), d, out=inv, where=d != 0)
    q = np.clip(_round_half_away(x * inv), -1, 1) + 1
    return _f16_bytes(d), q.astype(np.uint8)


# ------------------------------------------------------------------------------------- tq2_0


def quantize_tq2_0(x: np.ndarray) -> np.ndarray:
    d, q = _ternary(x.astype(_F32))
    fields = q.reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qs = np.bitwise_or.reduce(fields, axis=2).reshape(-1, 64)
    return np.concatenate([qs, d], axis=1)


def dequantize_tq2_0(b: np.ndarray) -> np.ndarray:
    d = _f16_value(b[:, 64:66])
    qs = b[:, :64].reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    q = (qs & 3).reshape(-1, TQ_BLOCK).astype(_F32) - _F32(1)
    return d * q


# ------------------------------------------------------------------------------------- tq1_0


def quantize_tq1_0(x: np.ndarray) -> np.ndarray:
    d, q = _ternary(x.astype(_F32))
    n = q.shape[0]
    # the digits of each byte as an integer 0..242, digit k worth 3**(4 - k) (digit 0, the
    # one a multiply by 3**0 reads, is the top of the fraction; qh's bytes hold digits 0..3
    # only), then scaled to a byte, rounding up
    value = np.zeros((n, 52), np.uint16)
    for k in range(5):
        sel = np.equal(_TQ1_DIGIT, k)
        value[:, _TQ1_BYTE[sel]] += q[:, sel].astype(np.uint16) * (3 ** (4 - k))
    packed = ((value * 256 + 242) // 243).astype(np.uint8)
    return np.concatenate([packed, d], axis=1)


def tq1_digits(b: np.ndarray) -> np.ndarray:
    """[n, 54] blocks -> [n, 256] digits 0..2 (the decoder's arithmetic, any byte value)."""
    scaled = b[:, _TQ1_BYTE] * _POW3[_TQ1_DIGIT]  # uint8: wraps mod 256 as intended
    return (scaled.astype(np.uint16) * 3) >> 8


def dequantize_tq1_0(b: np.ndarray) -> np.ndarray:
    d = _f16_value(b[:, 52:54])
    return d * (tq1_digits(b).astype(_F32) - _F32(1))


# ------------------------------------------------------------------------------------- mxfp4


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """The MXFP4 block scale halved, 2**(e - 128), exactly (subnormal for e < 2)."""
    e = e.astype(np.int32)
    return np.ldexp(_F32(1), e - 128).astype(_F32)


def quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    x = x.astype(_F32)
    amax = np.abs(x).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        top = np.floor(np.log2(amax))  # amax in [2**top, 2**(top + 1)): doubled E2M1's 4..8
    e = np.where(amax > 0, np.clip(top - 2 + 127, 0, 255), 0).astype(np.uint8)
    scale = e8m0_half(e)
    err = np.abs(x[:, :, None] - scale[:, :, None] * _E2M1)
    q = err.argmin(axis=2).astype(np.uint8)  # the first of equals, as gguf's argmin
    return np.concatenate([e, q[:, :16] | (q[:, 16:] << 4)], axis=1)


def dequantize_mxfp4(b: np.ndarray) -> np.ndarray:
    scale = e8m0_half(b[:, 0:1])
    q = np.concatenate([b[:, 1:] & 15, b[:, 1:] >> 4], axis=1)
    with np.errstate(over="ignore"):  # e near 255: 2**127 * 12 is inf, as in gguf
        return scale * _E2M1[q]


# -------------------------------------------------------------------------------------- q1_0

Q1_BLOCK = 128


def quantize_q1_0(x: np.ndarray) -> np.ndarray:
    """llama.cpp's reference: the scale is the block's mean magnitude, the bit the sign
    (set for x >= 0, -0.0 included)."""
    x = x.astype(_F32)
    d = (np.abs(x).astype(np.float64).sum(axis=1, keepdims=True) / Q1_BLOCK).astype(_F32)
    bits = np.packbits(np.greater_equal(x, 0).astype(np.uint8), axis=1, bitorder="little")
    return np.concatenate([_f16_bytes(d), bits], axis=1)


def dequantize_q1_0(b: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(b[:, 2:18], axis=1, bitorder="little").astype(_F32)
    return _f16_value(b[:, 0:2]) * (bits * _F32(2) - _F32(1))


# ------------------------------------------------------------------------------------- nvfp4

NVFP4_SUB = 16  # weights per UE4M3 scale; 4 sub-blocks a block
E4M3_MAX = 448.0


def ue4m3_half(s: np.ndarray) -> np.ndarray:
    """An unsigned E4M3 scale byte (bias 7) halved, as float32: ggml pairs it with the
    doubled E2M1 values. Bit 7 is ignored; 0x7F (E4M3's NaN) decodes to 0."""
    s = s.astype(np.int32)
    exp, man = (s >> 3) & 15, (s & 7).astype(_F32)
    normal = np.ldexp(_F32(1) + man / _F32(8), exp - 8).astype(_F32)
    value = np.where(exp == 0, man * _F32(2.0**-10), normal)
    return np.where(s == 0x7F, _F32(0), value).astype(_F32)


def ue4m3_bits(x: np.ndarray) -> np.ndarray:
    """float32 >= 0 -> an unsigned E4M3 byte, as ggml encodes scales: the 3 mantissa bits
    rounded on the next bit (half up), saturating at 448 (0x7E). Whether a value is
    subnormal is decided before rounding (so just under 2**-6 takes the subnormal 7/512,
    not the nearer 2**-6), as ggml does."""
    x = np.clip(x.astype(_F32), 0, E4M3_MAX)
    raw = x.view(np.uint32).astype(np.int64)
    exp0 = ((raw >> 23) & 255) - 127 + 7
    man = ((raw >> 20) & 7) + ((raw >> 19) & 1)
    exp, man = np.where(man > 7, exp0 + 1, exp0), np.where(man > 7, 0, man)
    normal = np.where(exp >= 15, 0x7E, (exp << 3) | man)
    sub = np.clip(np.trunc(x * _F32(512) + _F32(0.5)), 0, 7).astype(np.int64)
    return np.where(x <= 0, 0, np.where(exp0 <= 0, sub, normal)).astype(np.uint8)


def quantize_nvfp4(x: np.ndarray) -> np.ndarray:
    """Each 16-weight sub-block's scale puts its largest magnitude at E2M1's top (6); each
    weight takes the nearest scaled E2M1 value (the first in table order on a tie)."""
    sub = x.astype(_F32).reshape(x.shape[0], 4, NVFP4_SUB)
    scales = ue4m3_bits(np.abs(sub).max(axis=2) / _F32(6))
    step = ue4m3_half(scales)[:, :, None, None]
    q = np.abs(sub[..., None] - step * _E2M1).argmin(axis=3).astype(np.uint8)
    qs = q[..., :8] | (q[..., 8:] << 4)
    return np.concatenate([scales, qs.reshape(x.shape[0], 32)], axis=1)


def dequantize_nvfp4(b: np.ndarray) -> np.ndarray:
    qs = b[:, 4:].reshape(-1, 4, 8)
    q = np.concatenate([qs & 15, qs >> 4], axis=2)
    return (ue4m3_half(b[:, :4])[:, :, None] * _E2M1[q]).reshape(-1, 64)
