"""The lattice i-quants as 32-weight int8-kernel groups (`schedules.cpu.int8_codes.Group`),
for the AVX2 row kernels of `decode`, the column tiles of `batch_decode` and prefill on
both levels (`int8_codes.has_table`), and
prefill's VNNI tiles; iq3_s's vector decode for `schedules.cpu.int8_grid_row` at the end.

A group's codes are its grid values with their signs, as int8 (`signed`, as the other
i-quants'): the kernel multiplies them with q8_0's sign trick. Each entry's grid values are
one 4-byte load from the table parameter at the entry's index (8 loads per IQ3 group,
joined into one 32-byte vector); the 32 sign bits of the group are spread to one byte per
weight with a byte shuffle and a mask per bit position. The offset is 0, the scale
`d * (1 + 2 s)` (IQ3_S). Layouts: `decoders`.

IQ1_S has no signs: its codes are the grid values minus one (-1, 0, 1) and its shift of
+-1/8 is the group's offset. IQ1_M has none: its shift changes every 8 weights and its
scales every 16, which a group's two halves cannot hold.

Why: the float kernel decodes every weight through a lookup, a sign and a convert; on a
2048 x 2048 row (one thread, weights in cache) iq3_s took 4.87 ms there and 0.67 ms here
(`benchmarks/lattice_decode.py`; the package docstring has every type). Still 3-6x q4_0's
int8 kernel: the indices, sign bytes and table loads are scalar work per group.
"""

from __future__ import annotations

from tvm import tirx

from tallow.schedules.cpu.int8_codes import LANES, Group, Row, same_halves

from . import decoders


def _c(v: int):
    return tirx.const(v, "int32")


# byte i of a group's spread sign bytes is tested against bit i % 8
_BIT_OF_LANE = int.from_bytes(bytes(1 << i for i in range(8)), "little", signed=True)


def _apply_signs(values, word):
    """int8x32 `values` (0..127) negated where the group's sign bit is set: bit j of the
    uint32 `word` (byte j // 8, bit j % 8) is weight j's."""
    spread = tirx.Shuffle(  # byte j // 8 of the word in lane j (a Shuffle widens no vector)
        [tirx.reinterpret("uint8x32", tirx.Broadcast(word, 8))], [_c(i // 8) for i in range(LANES)]
    )
    bit = tirx.reinterpret("uint8x32", tirx.Broadcast(tirx.const(_BIT_OF_LANE, "int64"), 4))
    negative = tirx.NE(spread & bit, tirx.Broadcast(tirx.const(0, "uint8"), LANES))
    return tirx.Select(negative, tirx.Broadcast(tirx.const(0, "int8"), LANES) - values, values)


def _grid_values(row: Row, indices, width: int):
    """int8x32: the grid entries at `indices` (int32 expressions), `width` bytes each."""
    parts = [row.table.vload([q * width], f"uint8x{width}") for q in indices]
    return tirx.reinterpret("int8x32", tirx.Shuffle(parts, [_c(i) for i in range(LANES)]))


def _sign_bytes(row: Row, off):
    """The 4 sign bytes at `off` (one bit a weight) as a uint32."""
    return tirx.reinterpret("uint32", row.vec(off, 4))


def _sign_indices(indices):
    """A uint32 of 4 sign bytes from 7-bit sign indices (the 8th bit: their parity)."""
    word = tirx.const(0, "int32")
    for c, s in enumerate(indices):
        word = word | ((s | (decoders._parity(s) << 7)) << (8 * c))
    return word.astype("uint32")


def _zero():
    return tirx.const(0.0, "float32")


def iq3_s(row: Row, sub) -> Group:
    high = row.byte(66 + sub)
    indices = [row.byte(2 + sub * 8 + e) | (((high >> e) & 1) << 8) for e in range(8)]
    scale = (row.byte(106 + sub // 2) >> (sub % 2 * 4)) & 15
    codes = _apply_signs(_grid_values(row, indices, 4), _sign_bytes(row, 74 + sub * 4))
    d = row.half(0) * (1 + 2 * scale).astype("float32")
    return same_halves(codes, d, _zero(), signed=True)


def _xxs(row: Row, indices, aux_at: int, width: int, factor: float) -> Group:
    """iq3_xxs and iq2_xxs: a u32 holds the group's four 7-bit sign indices and its scale."""
    aux = decoders._u32(row, aux_at)
    signs = _sign_indices([(aux >> (7 * c)) & 127 for c in range(4)])
    codes = _apply_signs(_grid_values(row, indices, width), signs)
    d = row.half(0) * (0.5 + ((aux >> 28) & 15).astype("float32")) * factor
    return same_halves(codes, d, _zero(), signed=True)


def iq3_xxs(row: Row, sub) -> Group:
    indices = [row.byte(2 + sub * 8 + e) for e in range(8)]
    return _xxs(row, indices, 66 + sub * 4, 4, 0.5)


def iq2_xxs(row: Row, sub) -> Group:
    base = 2 + sub * 8
    return _xxs(row, [row.byte(base + c) for c in range(4)], base + 4, 8, 0.25)


def _halves(row: Row, codes, scales_at: int, sub) -> Group:
    """iq2_xs and iq2_s: a 4-bit scale per 16 weights, two to a byte."""
    d = row.half(0) * 0.25
    lo, hi = (((row.byte(scales_at + sub) >> (4 * h)) & 15).astype("float32") for h in (0, 1))
    return Group(codes, d * (0.5 + lo), d * (0.5 + hi), _zero(), _zero(), signed=True)


def iq2_xs(row: Row, sub) -> Group:
    at = [2 + 2 * (sub * 4 + c) for c in range(4)]  # a u16 per 8 weights
    words = [row.byte(a) | (row.byte(a + 1) << 8) for a in at]
    signs = _sign_indices([q >> 9 for q in words])
    codes = _apply_signs(_grid_values(row, [q & 511 for q in words], 8), signs)
    return _halves(row, codes, 66, sub)


def iq2_s(row: Row, sub) -> Group:
    high = row.byte(66 + sub)
    indices = [row.byte(2 + sub * 4 + c) | (((high >> (2 * c)) & 3) << 8) for c in range(4)]
    codes = _apply_signs(_grid_values(row, indices, 8), _sign_bytes(row, 34 + sub * 4))
    return _halves(row, codes, 74, sub)


def iq1_s(row: Row, sub) -> Group:
    """Codes G - 1 (-1, 0, 1: the table holds them plus one) and the grid's shift of +-1/8
    as the group's offset, `d (2 s + 1) delta`, which meets the activations' group sum."""
    at = 34 + sub * 2
    qh = row.byte(at) | (row.byte(at + 1) << 8)
    indices = [row.byte(2 + sub * 4 + c) | (((qh >> (3 * c)) & 7) << 8) for c in range(4)]
    codes = _grid_values(row, indices, 8) - tirx.Broadcast(tirx.const(1, "int8"), LANES)
    dl = row.half(0) * (2 * ((qh >> 12) & 7) + 1).astype("float32")
    delta = dl * decoders.DELTA * (1 - 2 * ((qh >> 15) & 1)).astype("float32")
    return same_halves(codes, dl, delta, signed=True)


def _every(period: int, times: int, lanes: int):
    """int32 lanes (lane % period) * times."""
    ramp = tirx.Ramp(_c(0), 1, lanes)
    return ramp % tirx.Broadcast(_c(period), lanes) * tirx.Broadcast(_c(times), lanes)


def iq3_s_indices(row: Row, g, count: int):
    """int32 x 8 count: the grid indices of groups g .. g + count - 1 (`GridCodes`): 8 low
    bytes each from 2 + 8g, the 9th bit e of byte 66 + g for entry e. The high bytes are
    bits 8 and up of the 32-bit word at 65 + g, so entry i's bit is bit 8 + i of it: one
    broadcast word, one variable shift and one ternary logic op (a byte spread took 4 more)."""
    lanes = 8 * count
    low = tirx.Cast(f"int32x{lanes}", row.vec(2 + 8 * g, lanes))
    word = tirx.Broadcast(tirx.reinterpret("int32", row.vec(65 + g, 4)), lanes)
    return low | ((word >> tirx.Ramp(_c(0), 1, lanes)) & tirx.Broadcast(_c(256), lanes))


def iq3_s_group_scales(row: Row):
    """float32x8: the block's 8 group scales `d * (1 + 2 s)`, s the 4-bit nibble g % 2 of byte
    106 + g // 2."""
    raw = tirx.Cast("int32x4", row.vec(106, 4))
    nibble = (tirx.Shuffle([raw] * 2, [_c(i // 2) for i in range(8)]) >> _every(2, 4, 8)) & (
        tirx.Broadcast(_c(15), 8)
    )
    odd = nibble * tirx.Broadcast(_c(2), 8) + tirx.Broadcast(_c(1), 8)
    return tirx.Broadcast(row.half(0), 8) * tirx.Cast("float32x8", odd)
