"""The legacy formats as 32-weight int8-kernel groups (`schedules.cpu.int8_codes.Group`):
one group is one block, `w = d * code + offset` with the same scale and offset for both
halves (see `schedules.cpu.int8_codes` for the scheme)."""

from __future__ import annotations

from tvm import tirx

from tallow.schedules.cpu.int8_codes import LANES, Group, Row, same_halves, u8


def _concat(lo, hi, lanes: int):
    return tirx.Shuffle([lo, hi], [tirx.const(i, "int32") for i in range(2 * lanes)])


def nibbles(row: Row, off: int):
    """Legacy packing: byte i holds weight i (low nibble) and weight i + 16 (high nibble)."""
    raw = row.vec(off, 16)
    return _concat(raw & u8(15, 16), raw >> u8(4, 16), 16)


def fifth_bits(row: Row, off: int):
    """Bit j of the 32-bit word at `off`, as 16 in byte j (0 otherwise)."""
    return word_bits(row, off) << u8(4)


def word_bits(row: Row, off):
    """Bit j of the 32-bit word at `off`, as 1 in byte j (0 otherwise).

    Byte j // 8 of the word is copied to lane j, masked with its lane's bit, and clamped to
    1: a byte shuffle, an and and a min, where per-lane variable shifts would be emulated.
    """
    word = tirx.reinterpret("int32", row.vec(off, 4))
    repeated = tirx.reinterpret("uint8x32", tirx.Broadcast(word, LANES // 4))
    spread = tirx.Shuffle([repeated], [tirx.const(j // 8, "int32") for j in range(LANES)])
    lane_bit = tirx.Cast("uint8x32", tirx.Ramp(tirx.const(0, "int32"), 1, LANES) % 8)
    masks = u8(1) << lane_bit
    return tirx.Min(spread & masks, u8(1))


def q8_0(row: Row, sub) -> Group:
    codes = tirx.reinterpret("int8x32", row.vec(2))
    return same_halves(codes, row.half(0), tirx.const(0.0, "float32"), signed=True)


def q4_0(row: Row, sub) -> Group:
    d = row.half(0)
    return same_halves(nibbles(row, 2), d, d * -8.0)


def q4_1(row: Row, sub) -> Group:
    return same_halves(nibbles(row, 4), row.half(0), row.half(2))


def q5_0(row: Row, sub) -> Group:
    d = row.half(0)
    return same_halves(nibbles(row, 6) | fifth_bits(row, 2), d, d * -16.0)


def q5_1(row: Row, sub) -> Group:
    codes = nibbles(row, 8) | fifth_bits(row, 4)
    return same_halves(codes, row.half(0), row.half(2))
