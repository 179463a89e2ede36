"""MXFP4, NVFP4 and Q1_0 as 32-weight int8-kernel groups (`schedules.cpu.int8_codes.Group`).
MXFP4: the 4-bit codes looked up in the doubled E2M1 table with one `vpshufb`
(`iquants.int8_groups.table_codes`), signed codes as the i-quants', scale `2**(e - 128)`,
offset 0.

The TQ types have none; they run the float fused dequantize-matmul:

* tq2_0's codes would be a shift and a mask (as q2k's), but most ternary weights are 0, and
  every tile that makes codes unsigned (the VNNI tiles' `code + 128` with offset
  `-128 * d`; unsigned codes 0..2 with offset `-d` anywhere) subtracts two nearly equal
  float32 sums: measured 60x (AVX2 row tiles, codes 0..2) and 3000x (VNNI tiles, signed
  codes -1..1 flipped) the int8 kernels' tolerance in `test_int8_decode` /
  `test_vnni_emulated`; only the AVX2 sign trick was exact.
* tq1_0's digits come from three runs of bytes of different widths (32, 16 and 4 weights a
  digit), so a 32-weight group would gather from two runs with per-lane multipliers.
"""

from __future__ import annotations

from tvm import tirx

from tallow.schedules.cpu.int8_codes import Group, Row, same_halves, u8

from ..iquants.int8_groups import table_codes
from ..legacy.int8_groups import nibbles, word_bits
from .numpy_codec import E2M1_X2
from .tir_decode import e8m0_half, ue4m3_half


def mxfp4(row: Row, sub) -> Group:
    codes = table_codes(nibbles(row, 1), E2M1_X2)
    return same_halves(codes, e8m0_half(row.byte(0)), tirx.const(0.0, "float32"), signed=True)


def nvfp4(row: Row, sub) -> Group:
    """Group `sub` (0, 1) of a 64-weight block: sub-blocks 2 sub and 2 sub + 1, 8 bytes each
    (low nibbles weights 0-7, high nibbles 8-15), so the codes are the low and high nibbles
    of the 16 bytes in 8-byte runs (a 64-bit interleave), looked up in the doubled E2M1
    table; each 16-weight half has its own UE4M3 scale."""
    raw = row.vec(4 + sub * 16, 16)
    lo, hi = raw & u8(15, 16), raw >> u8(4, 16)
    order = [*range(8), *range(16, 24), *range(8, 16), *range(24, 32)]
    indices = tirx.Shuffle([lo, hi], [tirx.const(i, "int32") for i in order])
    codes = table_codes(indices, E2M1_X2)
    zero = tirx.const(0.0, "float32")
    scale_lo, scale_hi = (ue4m3_half(row.byte(sub * 2 + h)) for h in (0, 1))
    return Group(codes, scale_lo, scale_hi, zero, zero, signed=True)


def q1_0(row: Row, sub) -> Group:
    """Group `sub` (0..3) of a 128-weight block: its 32 sign bits as codes 0 / 1 (a byte
    shuffle, an and and a min), so a weight is `2d * code - d`."""
    d = row.half(0)
    return same_halves(word_bits(row, 2 + sub * 4), d * 2.0, d * -1.0)
