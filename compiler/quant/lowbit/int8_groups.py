"""MXFP4 as 32-weight int8-kernel groups (`schedules.cpu.int8_codes.Group`): the 4-bit codes
looked up in the doubled E2M1 table with one `vpshufb` (`iquants.int8_groups.table_codes`),
signed codes as the i-quants', scale `2**(e - 128)`, offset 0.

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

from tallow.schedules.cpu.int8_codes import Group, Row, same_halves

from ..iquants.int8_groups import table_codes
from ..legacy.int8_groups import nibbles
from .numpy_codec import E2M1_X2
from .tir_decode import e8m0_half


def mxfp4(row: Row, sub) -> Group:
    codes = table_codes(nibbles(row, 1), E2M1_X2)
    return same_halves(codes, e8m0_half(row.byte(0)), tirx.const(0.0, "float32"), signed=True)
