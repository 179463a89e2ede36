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


# A super-block's scales and offsets as vectors (`Int8Codes.block_scales`): the row kernel
# decodes them once per 256 weights with a few vector instructions; decoding each group's
# with scalar byte arithmetic (above) cost about as much as the group's dot product. The
# products are the same float32 values as the groups' (exact: 11-bit f16 times 6-bit ints).


def _c(i: int):
    return tirx.const(i, "int32")


def _pick(v, idx):
    return tirx.Shuffle([v], [_c(i) for i in idx])


def _halves(lo: int, hi: int):
    """int32x8: `lo` in lanes 0-3, `hi` in lanes 4-7."""
    return tirx.Shuffle(
        [tirx.Broadcast(_c(lo), 4), tirx.Broadcast(_c(hi), 4)], [_c(i) for i in range(8)]
    )


def _blocks(per_block):
    """`block_scales` of one block -> of several (`*rows`): lanes block after block."""

    def scales(*rows: Row):
        parts = [per_block(r) for r in rows]
        if len(parts) == 1:
            return parts[0]
        lanes = len(parts) * 16  # (q2k, q6k: 16 scales per block)
        return tuple(
            tirx.Shuffle([p[i] for p in parts], [_c(j) for j in range(lanes)]) for i in range(2)
        )

    return scales


def _k4_block_scales(*rows: Row):
    """q4k / q5k: the 8 sub-blocks' 6-bit scales and mins (bytes 4..15, llama.cpp's
    get_scale_min_k4 for all 8 at once: lanes 0-3 whole bytes, 4-7 a low nibble plus the
    top 2 bits of another byte), for each of `rows` (super-blocks), 8 lanes after 8: two
    blocks' decode in 16-lane instructions costs about what one block's did in 8 lanes."""
    count = len(rows)
    lanes = 8 * count
    q = [tirx.Cast("int32x16", row.vec(4, 16)) for row in rows]  # lanes 0..11: the scales

    def pick(idx):
        return tirx.Shuffle(q, [_c(16 * b + i) for b in range(count) for i in idx])

    def halves(lo, hi):
        return tirx.Shuffle([_halves(lo, hi)] * count, [_c(i) for i in range(lanes)])

    six = tirx.Broadcast(_c(6), lanes)
    four = tirx.Broadcast(_c(4), lanes)
    low = halves(63, 15)
    high = halves(0, 48)
    sc = (pick([0, 1, 2, 3, 8, 9, 10, 11]) & low) | (
        ((pick([0, 1, 2, 3, 0, 1, 2, 3]) >> six) << four) & high
    )
    mn = ((pick([4, 5, 6, 7, 8, 9, 10, 11]) >> halves(0, 4)) & low) | (
        ((pick([4, 5, 6, 7, 4, 5, 6, 7]) >> six) << four) & high
    )
    # each block's f16 d and dmin: one 32-bit word, the blocks' words converted as one vector
    # and spread by a permute each (per-block broadcasts took ~12 instructions for two blocks)
    words = [tirx.reinterpret("int32", row.vec(0, 4)) for row in rows]
    joined = tirx.Shuffle(words, [_c(i) for i in range(count)]) if count > 1 else words[0]
    pairs = tirx.Cast(f"float32x{2 * count}", tirx.reinterpret(f"float16x{2 * count}", joined))
    ones = tirx.Broadcast(_c(1), 2 * count)
    signs = ones - (tirx.Ramp(_c(0), 1, 2 * count) % tirx.Broadcast(_c(2), 2 * count)) * 2
    signed = pairs * tirx.Cast(f"float32x{2 * count}", signs)  # d, -dmin, ...
    copies = [signed] * 4  # (a shuffle gives at most as many lanes as its inputs hold)
    d = tirx.Shuffle(copies, [_c(i // 8 * 2) for i in range(lanes)])
    dmin = tirx.Shuffle(copies, [_c(i // 8 * 2 + 1) for i in range(lanes)])
    return d * tirx.Cast(f"float32x{lanes}", sc), dmin * tirx.Cast(f"float32x{lanes}", mn)


def k4_int_scales(row: Row):
    """q4k / q5k for `IntBlockScales`: (the 6-bit sub-scales as int16x8, `d`, the offsets
    `-dmin * mn` as float32x8) of one super-block.

    The 12 scale bytes as three 32-bit words u0, u1, u2 (llama.cpp's reading): scales 0-3
    are `u0 & 0x3f..`, mins 0-3 `u1 & 0x3f..`, scales 4-7 the low nibbles of u2 with the
    top 2 bits of u0's bytes, mins 4-7 u2's high nibbles with u1's. In 4-lane words that is
    about 12 vector instructions for a block; `_k4_block_scales`' int32 lanes took 17.
    """
    words = tirx.reinterpret("int32x4", row.vec(4, 16))  # u0, u1, u2 (and a spare word)

    def word(v):
        return tirx.Broadcast(tirx.const(v, "int32"), 4)

    low = words & word(0x3F3F3F3F)  # [scales 0-3, mins 0-3, ...]
    u2 = _pick(words, [2, 2, 2, 2])
    nibbles = (u2 >> tirx.Shuffle([word(0), word(4)], [_c(0), _c(4), _c(1), _c(5)])) & word(
        0x0F0F0F0F
    )
    high = nibbles | ((words >> word(2)) & word(0x30303030))  # [scales 4-7, mins 4-7, ...]
    both = tirx.reinterpret("uint8x16", tirx.Shuffle([low, high], [_c(0), _c(4), _c(1), _c(5)]))
    sc = tirx.Cast("int16x8", _pick(both, range(8)))
    mn = tirx.Cast("float32x8", _pick(both, range(8, 16)))
    return sc, row.half(0), tirx.Broadcast(-row.half(2), 8) * mn


q4k_block_scales = _k4_block_scales
q5k_block_scales = _k4_block_scales


def _q2k_scales(row: Row):
    """q2k: 16 bytes, a 4-bit scale (low nibble) and min (high) per 16 weights."""
    s = tirx.Cast("int32x16", row.vec(0, 16))
    d = tirx.Broadcast(row.half(80), 16)
    dmin = tirx.Broadcast(-row.half(82), 16)
    return d * tirx.Cast("float32x16", s & tirx.Broadcast(_c(15), 16)), dmin * tirx.Cast(
        "float32x16", s >> tirx.Broadcast(_c(4), 16)
    )


def _q6k_scales(row: Row):
    """q6k: 16 int8 scales per 16 weights at 192; the offset is the scale times -32."""
    s = tirx.Cast("int32x16", tirx.reinterpret("int8x16", row.vec(192, 16)))
    scales = tirx.Broadcast(row.half(208), 16) * tirx.Cast("float32x16", s)
    return scales, scales * tirx.Broadcast(tirx.const(-32.0, "float32"), 16)


q2k_block_scales = _blocks(_q2k_scales)
q6k_block_scales = _blocks(_q6k_scales)
