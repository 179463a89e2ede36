"""Each GGUF block format as 32-weight groups of unsigned integer codes, for `cpu_int8_gemv`.

The integer dot-product kernel multiplies 32 weight codes by 32 int8 activations with AVX2's
`pmaddubsw` (unsigned x signed bytes). So every format is written here, per group `g` of 32
consecutive weights of one row, as

    w[g*32 + j] = scale_h * code[j] + offset_h,    h = j // 16 (the group's two halves)

with `code` a `uint8x32` vector in weight order and four float32 scalars (`scale_lo/hi`,
`offset_lo/hi`); the two halves differ only for the formats with 16-weight sub-blocks
(q2k, q3k, q6k). Signed formats are shifted to unsigned codes and the shift moves into the
offset (q4_0: `d*(q-8)` is code `q`, offset `-8d`). q8_0's codes are signed bytes and need
the full int8 range, so `signed=True` marks them for the kernel's sign trick instead.

The byte offsets are llama.cpp's block layouts, as `model_defs.quant_ops` documents them;
the scale and min helpers are that module's, so the two decoders cannot drift apart. The
kernels built from these are checked against `gguf.quants.dequantize` (tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import tirx

from tallow.model_defs.quant_ops import BLOCK, _k4_scale_min

LANES = 32  # weights per group: one 256-bit vector of byte codes
SIGNED = {"q8_0"}  # formats whose codes are int8 (see `Group.signed`)
SPLIT_HALVES = {"q2k", "q3k", "q6k"}  # formats whose two 16-weight halves differ in offset


@dataclass(frozen=True)
class Group:
    """One 32-weight group of one row, as TIR expressions."""

    codes: tirx.PrimExpr  # uint8x32 (int8x32 when signed)
    scale_lo: tirx.PrimExpr
    scale_hi: tirx.PrimExpr
    offset_lo: tirx.PrimExpr
    offset_hi: tirx.PrimExpr
    signed: bool = False


def _u8(v: int, lanes: int = LANES):
    return tirx.Broadcast(tirx.const(v, "uint8"), lanes)


def _splat(v, lanes: int = LANES):
    """A uint8 vector of a (possibly variable) small integer."""
    return tirx.Broadcast(tirx.Cast("uint8", v), lanes)


class Row:
    """Byte access to the blocks of row `n` of the weight buffer `w` (uint8 [N, row_bytes])."""

    def __init__(self, w: tirx.Buffer, n: tirx.PrimExpr, base: tirx.PrimExpr):
        self.w, self.n, self.base = w, n, base

    def byte(self, off):
        """One byte at `off` in the block, as int32 (what quant_ops' helpers expect)."""
        return self.w[self.n, self.base + off].astype("int32")

    def vec(self, off, lanes: int = LANES):
        return self.w.vload([self.n, self.base + off], f"uint8x{lanes}")

    def half(self, off: int):
        """The f16 at `off`, as float32.

        Read as one 32-bit load holding it (and a neighbour) and converted as a pair: a
        16-bit load became `vpinsrw` into a register that LLVM also used as an accumulator,
        a false dependency that serialised the whole loop (2x slower). The neighbour is the
        preceding f16 when there is one, so the read never passes the block's end.
        """
        first = off - 2 if off >= 2 else off
        pair = tirx.reinterpret("float16x2", self.vec(first, 4))
        return tirx.Shuffle([tirx.Cast("float32x2", pair)], [tirx.const(off - first, "int32") // 2])


def _concat(lo, hi, lanes: int):
    return tirx.Shuffle([lo, hi], [tirx.const(i, "int32") for i in range(2 * lanes)])


def _legacy_nibbles(row: Row, off: int):
    """Legacy packing: byte i holds weight i (low nibble) and weight i + 16 (high nibble)."""
    raw = row.vec(off, 16)
    return _concat(raw & _u8(15, 16), raw >> _u8(4, 16), 16)


def _legacy_fifth_bits(row: Row, off: int):
    """Bit j of the 32-bit word at `off`, as 16 in byte j (0 otherwise).

    Byte j // 8 of the word is copied to lane j, masked with its lane's bit, and clamped to
    1: a byte shuffle, an and and a min, where per-lane variable shifts would be emulated.
    """
    word = tirx.reinterpret("int32", row.vec(off, 4))
    repeated = tirx.reinterpret("uint8x32", tirx.Broadcast(word, LANES // 4))
    spread = tirx.Shuffle([repeated], [tirx.const(j // 8, "int32") for j in range(LANES)])
    bit = tirx.Cast("uint8x32", tirx.Ramp(tirx.const(0, "int32"), 1, LANES) % 8)
    masks = _u8(1) << bit
    return tirx.Min(spread & masks, _u8(1)) << _u8(4)


def _same(codes, scale, offset, signed=False) -> Group:
    return Group(codes, scale, scale, offset, offset, signed)


def _q8_0(row: Row, sub) -> Group:
    codes = tirx.reinterpret("int8x32", row.vec(2))
    return _same(codes, row.half(0), tirx.const(0.0, "float32"), signed=True)


def _q4_0(row: Row, sub) -> Group:
    d = row.half(0)
    return _same(_legacy_nibbles(row, 2), d, d * -8.0)


def _q4_1(row: Row, sub) -> Group:
    return _same(_legacy_nibbles(row, 4), row.half(0), row.half(2))


def _q5_0(row: Row, sub) -> Group:
    d = row.half(0)
    return _same(_legacy_nibbles(row, 6) | _legacy_fifth_bits(row, 2), d, d * -16.0)


def _q5_1(row: Row, sub) -> Group:
    codes = _legacy_nibbles(row, 8) | _legacy_fifth_bits(row, 4)
    return _same(codes, row.half(0), row.half(2))


# K-quants: `sub` is the group's index (0..7) inside its 256-weight super-block. Their code
# bits for 32 consecutive weights sit in 32 consecutive bytes, at a shift that depends on sub.


def _bits(row: Row, off, shift, mask: int):
    return (row.vec(off) >> _splat(shift)) & _u8(mask)


def _q2k(row: Row, sub) -> Group:
    codes = _bits(row, 16 + sub // 4 * 32, sub % 4 * 2, 3)
    d, dmin = row.half(80), row.half(82)
    lo, hi = row.byte(sub * 2), row.byte(sub * 2 + 1)

    def scale(s):
        return d * (s & 15).astype("float32")

    def offset(s):
        return -dmin * (s >> 4).astype("float32")

    return Group(codes, scale(lo), scale(hi), offset(lo), offset(hi))


def _q3k(row: Row, sub) -> Group:
    low = _bits(row, 32 + sub // 4 * 32, sub % 4 * 2, 3)
    high = tirx.Min(row.vec(0) & _splat(tirx.const(1, "int32") << sub), _u8(1)) << _u8(2)
    d = row.half(108)

    def scale(s):
        lo = (row.byte(96 + s % 8) >> (s // 8 * 4)) & 15
        hi = (row.byte(104 + s % 4) >> (s // 4 * 2)) & 3
        return d * ((lo | (hi << 4)) - 32).astype("float32")

    s_lo, s_hi = scale(sub * 2), scale(sub * 2 + 1)
    # code = low + 4*hmask bit; llama.cpp's value is scale * (code - 4)
    return Group(low | high, s_lo, s_hi, s_lo * -4.0, s_hi * -4.0)


def _k4_group(row: Row, sub, codes) -> Group:
    sc, mn = _k4_scale_min(row.byte, sub)
    return _same(codes, row.half(0) * sc.astype("float32"), -row.half(2) * mn.astype("float32"))


def _q4k(row: Row, sub) -> Group:
    return _k4_group(row, sub, _bits(row, 16 + sub // 2 * 32, sub % 2 * 4, 15))


def _q5k(row: Row, sub) -> Group:
    high = _bits(row, 16, sub, 1) << _u8(4)
    return _k4_group(row, sub, _bits(row, 48 + sub // 2 * 32, sub % 2 * 4, 15) | high)


def _q6k(row: Row, sub) -> Group:
    half, quarter = sub // 4, sub % 4
    low = _bits(row, half * 64 + quarter % 2 * 32, quarter // 2 * 4, 15)
    high = _bits(row, 128 + half * 32, quarter * 2, 3) << _u8(4)
    d = row.half(208)

    def scale(s):
        b = row.byte(192 + s)
        return d * (b - ((b >> 7) << 8)).astype("float32")  # the sub-scale is an int8

    s_lo, s_hi = scale(sub * 2), scale(sub * 2 + 1)
    return Group(low | high, s_lo, s_hi, s_lo * -32.0, s_hi * -32.0)


GROUPS: dict[str, Callable[[Row, tirx.PrimExpr], Group]] = {
    "q8_0": _q8_0,
    "q4_0": _q4_0,
    "q4_1": _q4_1,
    "q5_0": _q5_0,
    "q5_1": _q5_1,
    "q2k": _q2k,
    "q3k": _q3k,
    "q4k": _q4k,
    "q5k": _q5k,
    "q6k": _q6k,
}


def group(w: tirx.Buffer, qtype: str, n, g) -> Group:
    """Group `g` (weights g*32 .. g*32+31) of row `n` of `w`, a `qtype` weight."""
    block_weights, block_bytes = BLOCK[qtype]
    per_block = block_weights // LANES
    base = g // per_block * block_bytes if per_block > 1 else g * block_bytes
    return GROUPS[qtype](Row(w, n, base), g % per_block if per_block > 1 else 0)
