"""The i-quants as 32-weight int8-kernel groups (`schedules.cpu.int8_codes.Group`).

A group's codes are its table values `T[q]` themselves, as int8 (`signed`, as q8_0's): the
kernels multiply them with q8_0's sign trick, the VNNI tiles flip them to `T[q] + 128` and
move `-128 * scale` into the offset. The offset of the group is 0 and its scale `d` (iq4_nl)
or `d * (ls - 32)` (iq4_xs).

Why not unsigned codes `T[q] + 128` on AVX2: they reach 241, and `pmaddubsw` adds two
products of a code and an activation (|a| <= 127) in int16 with saturation: 2 * 241 * 127 =
61214 > 32767. The signed codes stay within 127 (2 * 127 * 127 = 32258). The same bound
rules out the AVX2 column tiles, which sum unsigned codes' products in int16 (`max_code`
would be 241: not one step fits, `int8_columns.flush_steps`).

The lookup is one `vpshufb` (AVX2; these kernels need it anyway): it indexes each 128-bit
half of a 32-byte table vector (the 16 values twice) by the low 4 bits of each code byte.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.schedules.cpu.int8_codes import Group, Row, same_halves

from ..legacy.int8_groups import nibbles
from .numpy_codec import TABLE, XS_MAX_SCALE
from .tir_decode import xs_group_scale


def _table_vector(table):
    """int8x32: `table` (16 int8 values) in each 128-bit half, from two int64 constants."""
    raw = bytes(int(v) & 0xFF for v in table)
    lo, hi = (int.from_bytes(raw[i : i + 8], "little", signed=True) for i in (0, 8))
    pair = [tirx.Broadcast(tirx.const(v, "int64"), 2) for v in (lo, hi)]
    words = tirx.Shuffle(pair, [tirx.const(i, "int32") for i in (0, 2, 1, 3)])
    return tirx.reinterpret("int8x32", words)


def table_codes(indices, table=TABLE):
    """uint8x32 table indices (0..15) -> int8x32 values of `table` (16 int8 values; the
    i-quants' by default, MXFP4's doubled E2M1 values in `lowbit`)."""
    return T.call_llvm_pure_intrin(
        "int8x32",
        "llvm.x86.avx2.pshuf.b",
        _table_vector(table),
        tirx.reinterpret("int8x32", indices),
    )


def iq4_nl(row: Row, sub) -> Group:
    return same_halves(
        table_codes(nibbles(row, 2)), row.half(0), tirx.const(0.0, "float32"), signed=True
    )


def iq4_xs(row: Row, sub) -> Group:
    scale = row.half(0) * xs_group_scale(row.byte, sub).astype("float32")
    codes = table_codes(nibbles(row, 8 + sub * 16))
    return same_halves(codes, scale, tirx.const(0.0, "float32"), signed=True)


def iq4_xs_group_scales(*rows: Row):
    """The 8 group scales `d * (ls - 32)` of each of `rows` (blocks), 8 lanes after 8, with
    vector shifts: `ls`'s low 4 bits are nibble g % 2 of byte 4 + g // 2, its high 2 bits bits
    2g, 2g + 1 of the u16 at byte 2 (`tir_decode.xs_group_scale` reads the same bits)."""
    count = len(rows)
    lanes = 8 * count
    raw = [tirx.Cast("int32x8", row.vec(0, 8)) for row in rows]  # bytes 0..7 of each block

    def pick(idx):
        return tirx.Shuffle(
            raw, [tirx.const(8 * b + i, "int32") for b in range(count) for i in idx]
        )

    def every(period: int, times: int):
        """int32 lanes (lane % period) * times: the per-lane shift counts."""
        ramp = tirx.Ramp(tirx.const(0, "int32"), 1, lanes)
        return (
            ramp
            % tirx.Broadcast(tirx.const(period, "int32"), lanes)
            * tirx.Broadcast(tirx.const(times, "int32"), lanes)
        )

    low = (pick([4, 4, 5, 5, 6, 6, 7, 7]) >> every(2, 4)) & tirx.Broadcast(
        tirx.const(15, "int32"), lanes
    )
    high = (pick([2, 2, 2, 2, 3, 3, 3, 3]) >> every(4, 2)) & tirx.Broadcast(
        tirx.const(3, "int32"), lanes
    )
    ls = (low | (high << tirx.Broadcast(tirx.const(4, "int32"), lanes))) - tirx.Broadcast(
        tirx.const(XS_MAX_SCALE, "int32"), lanes
    )
    d = tirx.Shuffle(
        [tirx.Broadcast(row.half(0), 8) for row in rows],
        [tirx.const(i, "int32") for i in range(lanes)],
    )
    return d * tirx.Cast(f"float32x{lanes}", ls)
