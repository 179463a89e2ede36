"""The VNNI one-row kernel's inner step for the legacy formats: 16 groups at a time.

A legacy block is one 32-weight group with its own f16 scale at its start (q4_0, q4_1, q5_0,
q5_1, q8_0: `Int8Codes.leading_scale`). Scaling each pair's 16 int32 lanes separately
(`int8_vnni_row`'s K-quant step) costs, per pair, two scalar f16 loads and converts, a
vector built from them, a permute to 16 lanes, a convert and an FMA, and the offsets' scalar
FMAs: about 20 instructions per 64 weights for q8_0, most of them not the dot product. Here
16 groups (8 `vpdpbusd`, one per pair) are summed down to one int32 lane per group by a tree
of two-source permutes and integer adds (exact: a group's sum fits easily), and then one
convert and one FMA apply the 16 groups' scales, read as one vector (one 32-bit word per
block holds its f16 scale and what follows it, as `int8_columns.legacy_scales` reads 16
rows'), times the activations' multipliers; one more FMA takes the 16 offsets.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from ..tir_common import add, reduce_lanes
from .int8_codes import LANES, codes_of
from .int8_vnni import COLS, _vpdpbusd

CHUNK = 16  # groups per step: one float lane each after the tree
PAIR = 2 * LANES


def _c(i: int):
    return tirx.const(i, "int32")


def applies(qtype: str) -> bool:
    return codes_of(qtype).leading_scale is not None


def _fold(a, b):
    """Two int32x16 whose lanes come in runs of r per group -> one with runs of r / 2: the
    even lanes of a then b, plus the odd ones (a permute each, an add)."""
    evens = tirx.Shuffle([a, b], [_c(2 * i) for i in range(COLS)])
    odds = tirx.Shuffle([a, b], [_c(2 * i + 1) for i in range(COLS)])
    return evens + odds


def group_sums(dots: list):
    """8 int32x16 (pair p: lanes 0-7 group 2p, 8-15 group 2p + 1) -> int32x16, lane g the
    sum of group g's 8 lanes."""
    while len(dots) > 1:
        dots = [_fold(dots[i], dots[i + 1]) for i in range(0, len(dots), 2)]
    return dots[0]


def group_scales(w, n, g0, count: int, qtype: str, row_bytes: int = 0):
    """(scales, offsets) of groups g0 .. g0 + count - 1 of row n, float32x16 (0 past count).

    Each block's first 32-bit word holds its f16 scale (and what follows). With the nibble
    formats' 64-byte windows (`pair_window`, loaded for the codes anyway) the 16 words come
    from them by one multi-source permute (a tree of two-source ones): per 16 groups about
    7 instructions where 16 separate word loads and inserts took about 25 (q5_0)."""
    block_bytes = get_format(qtype).type_size
    windows = [pair_window(w, qtype, n, g0 + 2 * p, row_bytes) for p in range(count // 2)]
    if windows and all(windows):
        zero = tirx.Broadcast(tirx.const(0, "uint8"), PAIR)
        idx = [
            p * PAIR + windows[p][1](j, b) if p < len(windows) else len(windows) * PAIR
            for p, j, b in ((i // 8, i // 4 % 2, i % 4) for i in range(PAIR))
        ]
        joined = tirx.reinterpret(
            "int32x16", tirx.Shuffle([v for v, _ in windows] + [zero], [_c(i) for i in idx])
        )
    else:
        zero = tirx.const(0, "int32")
        words = [
            tirx.reinterpret("int32", w.vload([n, (g0 + i) * block_bytes], "uint8x4"))
            if i < count
            else zero
            for i in range(CHUNK)
        ]
        joined = tirx.Shuffle(words, [_c(i) for i in range(CHUNK)])
    halves = tirx.reinterpret(f"float16x{2 * CHUNK}", joined)
    d = tirx.Cast("float32x16", tirx.Shuffle([halves], [_c(2 * i) for i in range(CHUNK)]))
    shift = codes_of(qtype).leading_scale.code_shift  # q8_0's -128 is the VNNI flip's too
    if shift is None:  # d, then the min
        mins = tirx.Shuffle([halves], [_c(2 * i + 1) for i in range(CHUNK)])
        return d, tirx.Cast("float32x16", mins)
    return d, d * tirx.Broadcast(tirx.const(shift, "float32"), CHUNK)


def pair_window(w, qtype: str, n, g, row_bytes: int):
    """(uint8x64 holding blocks g and g + 1 of row n, byte_at(j, off): where block g + j's
    byte `off` is in it), or None where the row is shorter than the window or the format has
    no nibble codes. The window starts at block g, or, for the row's last pair (g static),
    ends at the row's end, so no read passes the row except into the next row."""
    if codes_of(qtype).nibble_codes_at is None or row_bytes < PAIR:
        return None
    block_bytes = get_format(qtype).type_size
    last = isinstance(g, int) and (g + 2) * block_bytes == row_bytes
    shift = 2 * block_bytes - PAIR if last else 0

    def byte_at(j: int, off: int) -> int:
        return j * block_bytes + off - shift

    return w.vload([n, g * block_bytes + shift], "uint8x64"), byte_at


def nibble_pair_codes(w, qtype: str, n, g, row_bytes: int):
    """uint8x64: codes of groups g, g + 1 of the formats with legacy nibbles (byte i: weight
    i low, i + 16 high), and q5's fifth bits, built on 64 lanes at once from one 64-byte
    window holding both blocks (`pair_window`): one byte permute places each block's 16 code
    bytes twice, one and, one shift, one byte blend give the nibbles; a second permute of the
    same window spreads the fifth bits' bytes (a test, a masked 16): about 10 instructions a
    pair where gathering the two blocks' code bytes and fifth-bit words with small loads and
    inserts took about 16 (q5_0 9728 x 896, one thread, from memory: 11.5-13.7 -> 16.1-16.7
    GB/s with `group_scales` from the same windows; docs/benchmarks.md)."""
    at, fifth_at = codes_of(qtype).nibble_codes_at, codes_of(qtype).fifth_bits_at
    window = pair_window(w, qtype, n, g, row_bytes)
    if window is None:
        return _gathered_pair_codes(w, qtype, n, g)
    window, byte_at = window
    twice = tirx.Shuffle([window], [_c(byte_at(i // 32, at + i % 16)) for i in range(PAIR)])
    codes = _nibbles(twice)
    if fifth_at is None:
        return codes
    spread = tirx.Shuffle(
        [window], [_c(byte_at(i // 32, fifth_at + i % 32 // 8)) for i in range(PAIR)]
    )
    return codes | _sixteen_where_set(spread)


def _nibbles(twice):
    """Each block's 16 code bytes placed twice (lanes 0-31, 32-63) -> the 64 weights' codes."""
    low = twice & tirx.Broadcast(tirx.const(15, "uint8"), PAIR)
    high = twice >> tirx.Broadcast(tirx.const(4, "uint8"), PAIR)
    return tirx.Shuffle([low, high], [_c(i + (PAIR if i // 16 % 2 else 0)) for i in range(PAIR)])


def _sixteen_where_set(spread):
    """16 in lane i where bit i % 8 of its byte (the fifth bits' byte i // 8) is set."""
    masks = tirx.Broadcast(tirx.const(1, "uint8"), PAIR) << tirx.Cast(
        "uint8x64", tirx.Ramp(_c(0), 1, PAIR) % 8
    )
    return tirx.Select(
        (spread & masks) == masks,
        tirx.Broadcast(tirx.const(16, "uint8"), PAIR),
        tirx.Broadcast(tirx.const(0, "uint8"), PAIR),
    )


def _gathered_pair_codes(w, qtype: str, n, g):
    """`nibble_pair_codes` for rows shorter than the 64-byte window: small loads joined."""
    block_bytes = get_format(qtype).type_size
    at, fifth_at = codes_of(qtype).nibble_codes_at, codes_of(qtype).fifth_bits_at
    raw = [w.vload([n, (g + j) * block_bytes + at], "uint8x16") for j in range(2)]
    codes = _nibbles(tirx.Shuffle(raw * 2, [_c(i % 16 + i // 32 * 16) for i in range(PAIR)]))
    if fifth_at is None:
        return codes
    words = [
        tirx.reinterpret("int32", w.vload([n, (g + j) * block_bytes + fifth_at], "uint8x4"))
        for j in range(2)
    ]
    bytes8 = tirx.reinterpret("uint8x8", tirx.Shuffle(words, [_c(0), _c(1)]))
    return codes | _sixteen_where_set(tirx.Shuffle([bytes8] * 8, [_c(i // 8) for i in range(PAIR)]))


def dot_macro(qtype: str, groups: int, pair_codes):
    """A macro: row `n`'s result into `out[0, 0, n]` (arguments as `int8_vnni_row`'s); `sums`
    and `xmf` must hold zeros up to the next multiple of 16 groups."""
    # the loop leaves the row's last chunk to straight code: its last pair's window ends at the
    # row's end (`nibble_pair_codes`), so the loop's windows need not know where they are
    looped = (groups - 1) // CHUNK
    row_bytes = get_format(qtype).row_bytes(groups * LANES)
    if codes_of(qtype).nibble_codes_at is not None:

        def pair_codes(w, qtype, n, g):
            return nibble_pair_codes(w, qtype, n, g, row_bytes)

    def chunk(w, n, g0, count: int, xq, sums, xmf):
        dots = [
            _vpdpbusd(
                tirx.Broadcast(_c(0), COLS),
                pair_codes(w, qtype, n, g0 + 2 * p),
                xq.vload([0, (g0 + 2 * p) * LANES], "int8x64"),
            )
            for p in range(count // 2)
        ]
        dots += [tirx.Broadcast(_c(0), COLS)] * (CHUNK // 2 - len(dots))
        scales, offsets = group_scales(w, n, g0, count, qtype, row_bytes)
        dot = tirx.Cast("float32x16", group_sums(dots)) * (scales * xmf[tirx.Ramp(g0, 1, CHUNK)])
        return dot, offsets * sums[tirx.Ramp(g0, 1, CHUNK)]

    @T.macro
    def dot_row(w, n, xq, xr, sums, xmf, out):
        acc = T.sblock_alloc_buffer((2 * CHUNK,), "float32")  # dot products, offsets
        acc[T.Ramp(0, 1, 2 * CHUNK)] = T.Broadcast(T.float32(0), 2 * CHUNK)
        for c in range(looped):
            step = T.meta_var(chunk(w, n, c * CHUNK, CHUNK, xq, sums, xmf))
            acc[T.Ramp(0, 1, CHUNK)] = acc[T.Ramp(0, 1, CHUNK)] + step[0]
            acc[T.Ramp(CHUNK, 1, CHUNK)] = acc[T.Ramp(CHUNK, 1, CHUNK)] + step[1]
        last = T.meta_var(chunk(w, n, looped * CHUNK, groups - looped * CHUNK, xq, sums, xmf))
        acc[T.Ramp(0, 1, CHUNK)] = acc[T.Ramp(0, 1, CHUNK)] + last[0]
        acc[T.Ramp(CHUNK, 1, CHUNK)] = acc[T.Ramp(CHUNK, 1, CHUNK)] + last[1]
        out[0, 0, n] = xr[0] * reduce_lanes(acc[T.Ramp(0, 1, CHUNK)], CHUNK, add) + reduce_lanes(
            acc[T.Ramp(CHUNK, 1, CHUNK)], CHUNK, add
        )

    return dot_row
