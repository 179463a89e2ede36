"""The K-quants as 32-weight int8-kernel groups (`schedules.cpu.int8_codes.Group`).

A 256-weight super-block is 8 groups; the formats with 16-weight sub-blocks (q2k, q3k, q6k)
give each half of a group its own scale and offset (see `schedules.cpu.int8_codes`).
"""

from __future__ import annotations

from tvm import tirx

from tallow.schedules.cpu.int8_codes import Group, Row, bits, same_halves, splat, u8

from .tir_decode import k4_scale_min

# `sub` is the group's index (0..7) inside its 256-weight super-block. The code
# bits for 32 consecutive weights sit in 32 consecutive bytes, at a shift that depends on sub.


def q2k(row: Row, sub) -> Group:
    codes = bits(row, 16 + sub // 4 * 32, sub % 4 * 2, 3)
    d, dmin = row.half(80), row.half(82)
    lo, hi = row.byte(sub * 2), row.byte(sub * 2 + 1)

    def scale(s):
        return d * (s & 15).astype("float32")

    def offset(s):
        return -dmin * (s >> 4).astype("float32")

    return Group(codes, scale(lo), scale(hi), offset(lo), offset(hi))


def q3k(row: Row, sub) -> Group:
    low = bits(row, 32 + sub // 4 * 32, sub % 4 * 2, 3)
    high = tirx.Min(row.vec(0) & splat(tirx.const(1, "int32") << sub), u8(1)) << u8(2)
    d = row.half(108)

    def scale(s):
        lo = (row.byte(96 + s % 8) >> (s // 8 * 4)) & 15
        hi = (row.byte(104 + s % 4) >> (s // 4 * 2)) & 3
        return d * ((lo | (hi << 4)) - 32).astype("float32")

    s_lo, s_hi = scale(sub * 2), scale(sub * 2 + 1)
    # code = low + 4*hmask bit; llama.cpp's value is scale * (code - 4)
    return Group(low | high, s_lo, s_hi, s_lo * -4.0, s_hi * -4.0)


def _k4_group(row: Row, sub, codes) -> Group:
    sc, mn = k4_scale_min(row.byte, sub)
    return same_halves(
        codes, row.half(0) * sc.astype("float32"), -row.half(2) * mn.astype("float32")
    )


def q4k(row: Row, sub) -> Group:
    return _k4_group(row, sub, bits(row, 16 + sub // 2 * 32, sub % 2 * 4, 15))


def q5k(row: Row, sub) -> Group:
    high = bits(row, 16, sub, 1) << u8(4)
    return _k4_group(row, sub, bits(row, 48 + sub // 2 * 32, sub % 2 * 4, 15) | high)


def q6k(row: Row, sub) -> Group:
    half, quarter = sub // 4, sub % 4
    low = bits(row, half * 64 + quarter % 2 * 32, quarter // 2 * 4, 15)
    high = bits(row, 128 + half * 32, quarter * 2, 3) << u8(4)
    d = row.half(208)

    def scale(s):
        b = row.byte(192 + s)
        return d * (b - ((b >> 7) << 8)).astype("float32")  # the sub-scale is an int8

    s_lo, s_hi = scale(sub * 2), scale(sub * 2 + 1)
    return Group(low | high, s_lo, s_hi, s_lo * -32.0, s_hi * -32.0)
