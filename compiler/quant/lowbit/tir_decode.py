"""TIR decoders of TQ1_0, TQ2_0 and MXFP4: `(byte, j) -> float32` weight j of a block.

======  ====  ===========================================================================
type    size  layout (offsets in bytes; see `numpy_codec` for the fields)
======  ====  ===========================================================================
tq2_0   66    qs[64] @0 (2-bit fields), d:f16 @64                       w = d*(q-1)
tq1_0   54    qs[48] @0, qh[4] @48 (base-3 digits), d:f16 @52            w = d*(digit-1)
mxfp4   17    e:u8 @0, qs[16] @1 (lo nibble w[i], hi w[i+16])    w = 2^(e-128)*E2M1_X2[q]
q1_0    18    d:f16 @0, bits[16] @2 (bit j%8 of byte j/8)                w = d*(2*bit-1)
nvfp4   36    s:u8[4] @0 (UE4M3 per 16 weights), qs[32] @4 (8 bytes a sub-block: lo
              nibble w[i], hi w[i+8])                           w = s/2*E2M1_X2[q]
======  ====  ===========================================================================

Pure arithmetic on the block's bytes, as the other families' decoders, so the CPU's and the
GPU schedules take these formats unchanged. TQ1_0's digit `k` of a byte is
`((byte * 3**k) & 255) * 3 >> 8`; which byte and which `k` a weight reads are selects on its
index (three runs: 32, 16 and 4 bytes wide), `3**k` a `small_table`. MXFP4's scale is built
as float32 bits (`0x00200000 << e` for the two subnormal scales, `(e - 1) << 23` above);
NVFP4's halved UE4M3 scale as `(exp + 119) << 23 | man << 20`, its subnormals `man * 2**-10`.

Bit-exact with `gguf.quants.dequantize`: an f16 or a power of two times an integer of at
most 4 bits is exact in float32.
"""

from __future__ import annotations

from tvm import tirx

from ..tir_bytes import f32, half, small_table
from .numpy_codec import E2M1_X2

e2m1_x2 = small_table(E2M1_X2)  # the MXFP4 code q (0..15) -> its doubled E2M1 value
_pow3 = small_table([1, 3, 9, 27, 81] + [0] * 11)


def _index(j):
    """j as an int32 expression (the GPU schedules can hand an int64 one: see `small_table`)."""
    return tirx.const(j, "int32") if isinstance(j, int) else j.astype("int32")


def tq2_0(byte, j):
    q = (byte(j // 128 * 32 + j % 32) >> (j % 128 // 32 * 2)) & 3
    return half(byte, 64) * f32(q - 1)


def tq1_0(byte, j):
    j = _index(j)
    first, second = j < 160, j < 240
    off = tirx.Select(first, j % 32, tirx.Select(second, 32 + j % 16, 48 + j % 4))
    k = tirx.Select(first, j // 32, tirx.Select(second, j // 16 - 10, j // 4 - 60))
    digit = (((byte(off) * _pow3(k)) & 255) * 3) >> 8
    return half(byte, 52) * f32(digit - 1)


def e8m0_half(e):
    """2**(e - 128) as float32, for an int32 expression e in 0..255 (MXFP4's halved scale)."""
    bits = tirx.Select(e < 2, tirx.const(0x00200000, "int32") << e, (e - 1) << 23)
    return tirx.reinterpret("float32", bits)


def mxfp4(byte, j):
    q = (byte(1 + j % 16) >> (j % 32 // 16 * 4)) & 15
    return e8m0_half(byte(0)) * f32(e2m1_x2(q))


def q1_0(byte, j):
    bit = (byte(2 + j // 8) >> (j % 8)) & 1
    return half(byte, 0) * f32(bit * 2 - 1)


def ue4m3_half(s):
    """An unsigned E4M3 scale (int32 0..255, bit 7 ignored) halved, as float32; 0x7F is 0."""
    exp, man = (s >> 3) & 15, s & 7
    normal = tirx.reinterpret("float32", ((exp + 119) << 23) | (man << 20))
    sub = f32(man) * tirx.const(2.0**-10, "float32")
    zero = tirx.const(0.0, "float32")
    return tirx.Select(s == 0x7F, zero, tirx.Select(exp == 0, sub, normal))


def nvfp4(byte, j):
    q = (byte(4 + j // 16 * 8 + j % 8) >> (j % 16 // 8 * 4)) & 15
    return ue4m3_half(byte(j // 16)) * f32(e2m1_x2(q))
