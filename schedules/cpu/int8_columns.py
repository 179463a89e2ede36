"""Batched decode, column-vectorized: one vector holds 8 output columns of one sequence.

(AVX2. CPUs with AVX-512 VNNI take `int8_vnni`'s 16-column tiles instead, built on the
transposes below.)

`int8_batched`'s tiles keep a group's products in the lanes of one sequence's vector,
so every group of every (sequence, column) pair ends in a `pmaddwd`, a convert and an FMA
to fold those lanes and apply the group's scale: four vector instructions per 32 weights,
at AVX2's limit. Here the 8 lanes are 8 output columns instead:

* a group's codes for 8 columns are transposed once per tile of up to 16 sequences (24
  shuffles), so that vector `s` holds weights `4s..4s+3` of each of the 8 columns;
* per sequence, the 4 activations `4s..4s+3` are broadcast to all lanes and one
  `pmaddubsw` multiplies them with the 8 columns' codes at once; its int16 pair sums are
  added up across steps in int16 (no overflow: see `flush_steps`), and one `pmaddwd`
  (times the activations' group multiplier), one convert and one FMA with the 8 columns'
  scales finish the group for all 8 columns.

For 4-bit codes that is about 19 vector instructions per sequence, group and 8 columns, where
the row tiles spend 32. q4_0 and q4_1 skip the decode-then-transpose: their nibble bytes
transpose directly (`nibble_steps`, 24 instructions per group and 8 columns, not 56).

The tile reads its 8 weight rows a row apart, which the hardware prefetchers do not follow:
with the weights coming from memory (as in a model's step, not a benchmark loop) the first
version was slower than the row tiles, 0.80 against 0.67 ms. Each group now prefetches the
same group of the next 8 rows. `benchmarks/decode_matmul.py --cold`, SmolLM2's q4_1 gate/up
projection (3072 x 576), weights from memory, 2 threads: 16 sequences 0.658 -> 0.421 ms,
8 sequences 0.355 -> 0.249 ms against the row tiles. The transpose costs a fixed amount per
tile, and small batches had kept the row tiles; measured again with the prefetch
(`decode_matmul.py --tiles`: AMD EPYC Zen 3, one thread, CPU time, weights from memory),
the column tiles win or tie below 8 sequences too: SmolLM2's q4_1 gate/up at 1, 2, 4 and 6
sequences 91, 98, 138 and 183 us against the row tiles' 101, 130, 181 and 306 us; the
K-quants from 0.49x (q4k) to 1.21x (q5k at 1 sequence) of the row tiles' time (each family
package under `compiler/quant/` has its figures). So the formats that have them
(`column_tiles`) take them at every batch size, and a row's
result never depends on the batch: each row and column sums its groups in order into one
float, whatever the tile's row count or the row's place in it (`--deterministic`).
The activations are quantized as `int8_ops` documents; the results are those of the other
kernels up to float summation order (tests: numpy on `gguf`'s dequantizers, codes at the
int16 / int32 bounds, and every row of batches 1 to 17 against the row alone).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from ..tir_common import prefetch
from .int8_codes import LANES, codes_of, group, u8
from .int8_ops import M_MAX, MULT_LANES, WORD_LANES, offset_halves

COLS = 8  # output columns per vector (int32 / float32 lanes)
STEPS = LANES // 4  # 4-weight steps per group
ROWS = 16  # sequences per tile: the transposed codes are reused this many times
INT16_MAX = 32767


def _steps_in_int16(bound: int) -> int:
    """Steps whose int16 pair sums (two products, code * activation, |activation| <= 127,
    |code| <= `bound`) can be added before `pmaddwd` widens them to int32."""
    steps = INT16_MAX // (2 * 127 * bound)
    return max(s for s in (1, 2, 4, 8) if s <= steps)


def unsigned_view(qtype: str) -> tuple[int, int] | None:
    """(bias, shift) when the tiles take a lattice format's signed codes as unsigned ones,
    `(code + bias) >> shift`, the scale times `2**shift` and the offset less `bias` scales; or
    None (the sign trick).

    A lattice format's codes are grid values with signs (IQ1_S: the value minus one), so the
    grid's largest entry `b` bounds them: `code + b` lies in 0..2b, and where every entry is
    odd (iq3_s: 1, 3, .., 15) `(code + b) / 2` is a whole number in 0..b, as a 4-bit
    format's. Taken where it adds up as many steps in int16 as the sign trick does: then each
    row saves the trick's `psignb` a step (iq3_s, iq1_s; not iq3_xxs or the IQ2 types, whose
    doubled range would halve the steps). Transposed codes are rebiased once per group and
    tile of rows, not per row."""
    table = get_format(qtype).table
    if table is None or not codes_of(qtype).signed:
        return None
    grid = table()
    b = int(grid.max())
    shift = 1 if (grid % 2 == 1).all() else 0
    unsigned = (2 * b) >> shift
    return (b, shift) if _steps_in_int16(unsigned) >= _steps_in_int16(b) else None


def code_bound(qtype: str) -> int:
    """The largest code magnitude `pmaddubsw` sees: `max_code` for unsigned codes, the
    largest after `unsigned_view`, the largest grid entry for the other lattice formats
    (signed, their codes are grid values with signs), 127 for the other signed formats (the
    sign trick multiplies |code| with the activation given the code's sign). A small bound
    lets more steps add up in int16 before `pmaddwd`."""
    codes = codes_of(qtype)
    if not codes.signed:
        return codes.max_code
    view = unsigned_view(qtype)
    if view is not None:
        return (2 * view[0]) >> view[1]
    table = get_format(qtype).table
    return 127 if table is None else int(table().max())


def flush_steps(qtype: str) -> int:
    """Steps whose int16 pair sums can be added before `pmaddwd` widens them to int32."""
    return _steps_in_int16(code_bound(qtype))


def multiplier_in_int32(qtype: str) -> bool:
    """Whether a whole scale block's dot product times the activations' group multiplier
    (up to `M_MAX`) fits in int32, so `pmaddwd` can apply the multiplier.

    True for the 4-bit formats and q2k/q3k. The others (q5k, q6k) sum in int32 without
    it (`pmaddwd` by ones) and multiply it in float.
    """
    weights = LANES // offset_halves(qtype)
    return M_MAX * weights * code_bound(qtype) * 127 < 2**31


def _c(i: int):
    return tirx.const(i, "int32")


def _shuffle(a, b, idx):
    return tirx.Shuffle([a, b], [_c(i) for i in idx])


# Two-input shuffles of int32x8 within 128-bit halves: x86's 32- and 64-bit unpacks.
LO32, HI32 = (0, 8, 1, 9, 4, 12, 5, 13), (2, 10, 3, 11, 6, 14, 7, 15)
LO64, HI64 = (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15)


def transpose(vecs):
    """8 int32x8 vectors in, 8 out, with out[s][c] = vecs[c][s].

    Three rounds of two-input shuffles that x86 has as single instructions: 32-bit and
    64-bit unpacks within 128-bit halves, then 128-bit permutes (24 in all).
    """
    pairs = []  # pairs[2j]: steps 0,1 | 4,5 of columns 2j, 2j+1; pairs[2j+1]: 2,3 | 6,7
    for c in range(0, 8, 2):
        pairs += [_shuffle(vecs[c], vecs[c + 1], LO32), _shuffle(vecs[c], vecs[c + 1], HI32)]
    quads = []  # quads[4h + s]: step s (low half) and s + 4 (high half) of columns 4h..4h+3
    for h in (0, 4):
        for first, second in ((pairs[h], pairs[h + 2]), (pairs[h + 1], pairs[h + 3])):
            quads += [_shuffle(first, second, LO64), _shuffle(first, second, HI64)]
    low, high = (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)
    out = [None] * STEPS
    for s in range(4):
        out[s] = _shuffle(quads[s], quads[4 + s], low)
        out[s + 4] = _shuffle(quads[s], quads[4 + s], high)
    return out


# The legacy 4-bit formats keep a group's codes as 16 bytes after the f16 scale (and min):
# byte i holds weight i (low nibble) and weight i + 16 (high nibble). Where they start is
# the format's `Int8Codes.nibble_codes_at`.


def nibble_steps(w, n0, g, block_bytes: int, start: int):
    """The 8 step vectors of `transpose` for a legacy 4-bit format, straight from the bytes.

    Columns c and c + 4 share a 256-bit vector, and a 4x4 transpose of 32-bit words within
    each half gives word j (weights 4j..4j+3 in the low nibbles, 16+4j.. in the high) of all
    8 columns: step j is its low nibbles, step 4 + j its high ones. 24 instructions where
    decoding each column and transposing takes 56.
    """

    def raw(c):
        return w.vload([n0 + c, g * block_bytes + start], "uint8x16")

    pairs = [
        tirx.reinterpret("int32x8", tirx.Shuffle([raw(c), raw(c + 4)], [_c(i) for i in range(32)]))
        for c in range(4)
    ]
    words = []
    for half in (LO32, HI32):
        a, b = _shuffle(pairs[0], pairs[1], half), _shuffle(pairs[2], pairs[3], half)
        words += [_shuffle(a, b, LO64), _shuffle(a, b, HI64)]
    mask = tirx.Broadcast(tirx.const(0x0F0F0F0F, "int32"), COLS)
    shift = tirx.Broadcast(tirx.const(4, "int32"), COLS)
    return [v & mask for v in words] + [(v >> shift) & mask for v in words]


# The legacy formats keep a group's f16 scale (and, for q4_1 / q5_1, the f16 min after it)
# at the start of the block; the others' offset is the scale times a code shift (the
# format's `Int8Codes.leading_scale`).


def legacy_scales(w, n0, g, qtype: str, cols: int):
    """(scales, offsets) of rows `n0..n0+cols-1`'s group `g`, float32 x `cols`, for the
    legacy block formats: one 32-bit word per row holds the f16 scale and what follows it
    (the min, or a code)."""
    block_bytes = get_format(qtype).type_size
    words = [
        tirx.reinterpret("int32", w.vload([n0 + c, g * block_bytes], "uint8x4"))
        for c in range(cols)
    ]
    halves = tirx.reinterpret(
        f"float16x{2 * cols}", tirx.Shuffle(words, [_c(i) for i in range(cols)])
    )
    d = tirx.Cast(f"float32x{cols}", tirx.Shuffle([halves], [_c(2 * i) for i in range(cols)]))
    shift = codes_of(qtype).leading_scale.code_shift
    if shift is None:  # d, then the min
        mins = tirx.Shuffle([halves], [_c(2 * i + 1) for i in range(cols)])
        return d, tirx.Cast(f"float32x{cols}", mins)
    return d, d * tirx.Broadcast(tirx.const(shift, "float32"), cols)


def scales_macro(qtype: str, cols: int, sign_trick: bool = False):
    """A macro storing group `g`'s scales and offsets for rows `n0..n0+cols-1` into `sc`:
    [scales lo | scales hi | offsets lo | offsets hi], `cols` each (the hi ones only for the
    formats whose halves differ). Legacy formats read them as vectors; the K-quants decode
    each row's.

    `sign_trick`: the caller multiplies signed codes as they are (these AVX2 tiles), so
    their offset is zero; the VNNI tiles flip them to `code + 128` and keep the `-128 * d`
    offset `legacy_scales` gives."""
    halves = offset_halves(qtype)
    leading_scale = codes_of(qtype).leading_scale is not None
    signed = sign_trick and codes_of(qtype).signed
    zero = tirx.Broadcast(tirx.const(0.0, "float32"), cols)

    @T.macro
    def store(sc, w, n0, g, table=None):
        if leading_scale:
            sv = T.meta_var(legacy_scales(w, n0, g, qtype, cols))
            sc[T.Ramp(0, 1, cols)] = sv[0]
            sc[T.Ramp(2 * cols, 1, cols)] = zero if signed else sv[1]
        else:
            for c in T.unroll(cols):
                sc[c] = group(w, qtype, n0 + c, g, table).scale_lo
                sc[2 * cols + c] = group(w, qtype, n0 + c, g, table).offset_lo
                if halves == 2:
                    sc[cols + c] = group(w, qtype, n0 + c, g, table).scale_hi
                    sc[3 * cols + c] = group(w, qtype, n0 + c, g, table).offset_hi

    return store


def magnitude32(words):
    """|code| of the 32 signed int8 codes in `words` (int32x8), as int32x8."""
    codes = tirx.reinterpret("int8x32", words)
    return tirx.reinterpret(
        "int32x8", T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", codes, codes)
    )


def _pmaddubsw(codes, x):
    return T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", codes, x)


def _pmaddwd(pairs, m):
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, m)


def add_terms(total, terms):
    """`total + terms[0] + terms[1] + ...`, left to right: an FMA per product term."""
    for term in terms:
        total = total + term
    return total


@T.macro
def store8(buf, at, vectors):
    """Eight int32x8 vectors (a Python list: a group's 8 steps) into `buf[at:at + 64]`; a
    macro, as TVMScript takes the list's items only by constant index."""
    buf[T.Ramp(at, 1, 8)] = vectors[0]
    buf[T.Ramp(at + 8, 1, 8)] = vectors[1]
    buf[T.Ramp(at + 16, 1, 8)] = vectors[2]
    buf[T.Ramp(at + 24, 1, 8)] = vectors[3]
    buf[T.Ramp(at + 32, 1, 8)] = vectors[4]
    buf[T.Ramp(at + 40, 1, 8)] = vectors[5]
    buf[T.Ramp(at + 48, 1, 8)] = vectors[6]
    buf[T.Ramp(at + 56, 1, 8)] = vectors[7]


def tile_macro(qtype: str, groups: int, max_rows: int = ROWS, group_major: bool = False):
    """A macro: columns `n0..n0+7` for `rows` (<= `max_rows`) sequences from `r0`, the whole K.

    Arguments as `int8_batched`'s tiles: the weight buffer and the quantized activations
    (xq, xm, xr, xs), then `out`, and a lattice format's grid (`table`). Prefill
    (`int8_prefill_columns`) takes more rows per tile than decode, to share each group's
    transpose among them, and reads xq and xm group-major (`group_major`, see
    `int8_ops.quantize_macro`); there `xm` is one word per row and group (`m` twice), or, for
    the formats that apply `m` in float, float32 `[groups, rows]`.
    """
    halves = offset_halves(qtype)
    view = unsigned_view(qtype)
    signed = codes_of(qtype).signed and view is None  # (the sign trick)
    half_steps = STEPS // 2 if halves == 2 else STEPS  # steps under one scale
    flush = min(flush_steps(qtype), half_steps)
    in_int32 = multiplier_in_int32(qtype)

    block_weights, block_bytes = get_format(qtype).block_size, get_format(qtype).type_size
    nibble_codes_at = codes_of(qtype).nibble_codes_at
    # (the 5-bit formats' nibbles need their fifth bits: those decode each column)
    nibbles = nibble_codes_at is not None and codes_of(qtype).fifth_bits_at is None
    store_scales = scales_macro(qtype, COLS, sign_trick=True)

    def prefetch_group(w, n, g):
        """Prefetch about where group `g` of row `n` sits (the row clamped to the last one)."""
        byte = g * LANES * block_bytes // block_weights
        return prefetch(tirx.address_of(w[tirx.min(n, w.shape[0] - 1), byte]))

    def codes32(w, n, g):
        return tirx.reinterpret("int32x8", group(w, qtype, n, g).codes)

    if view is not None:  # the scale of one unit of `unsigned_view`'s codes, and its bias
        bias = tirx.Broadcast(tirx.const(float(view[0]), "float32"), COLS)
        step = tirx.Broadcast(tirx.const(float(1 << view[1]), "float32"), COLS)

    def rebias(words):
        """`unsigned_view`'s codes from 32 signed ones (int32x8 in, int32x8 out)."""
        codes = tirx.reinterpret("uint8x32", words) + u8(view[0])
        if view[1]:
            codes = codes >> u8(view[1])
        return tirx.reinterpret("int32x8", codes)

    def stored32(cb, c):
        """Row `c`'s codes of the group, decoded into `cb` already (a lattice format)."""
        return tirx.reinterpret("int32x8", cb.vload([c * LANES], "int8x32"))

    def broadcast(xq, row, g, s):
        """Activations 4s..4s+3 of the group, in every 32-bit lane."""
        at = [g, row, s * 4] if group_major else [row, g * LANES + s * 4]
        word = tirx.reinterpret("int32", xq.vload(at, "int8x4"))
        return tirx.reinterpret("int8x32", tirx.Broadcast(word, COLS))

    def product(ct, s, x):
        """16 int16: per column, the two pair sums of step `s`. Signed codes: `ct` holds
        |code| at steps 0..STEPS-1 and the codes themselves after, whose signs move onto the
        activations (`psignb`), so the unsigned side stays |code| <= 127."""
        codes = tirx.reinterpret("uint8x32", ct.vload([s * COLS], "int32x8"))
        if signed:
            sign = tirx.reinterpret("int8x32", ct.vload([(STEPS + s) * COLS], "int32x8"))
            x = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", x, sign)
        return _pmaddubsw(codes, x)

    def half_sum(ct, xq, m, row, g, h):
        """int32 per column: the products of the steps under scale `h`, times `m`."""
        total = None
        for first in range(h * half_steps, (h + 1) * half_steps, flush):
            pairs = None
            for s in range(first, first + flush):
                p = product(ct, s, broadcast(xq, row, g, s))
                pairs = p if pairs is None else pairs + p
            part = _pmaddwd(pairs, m)
            total = part if total is None else total + part
        return total

    def update(ct, sc, xq, xm, xs, row, g):
        """Per column: this group's terms for `acc` and for `off` (each added in turn, so
        that every term is one FMA): its products times the scales, its offsets times the
        activation sums."""
        m_at = [g, row, 0] if group_major else [row, g * MULT_LANES]
        if in_int32 and group_major:  # m twice in one word (int8_ops.quantize_macro)
            word = tirx.reinterpret("int32", xm.vload(m_at, f"int16x{WORD_LANES}"))
            m = tirx.reinterpret(f"int16x{MULT_LANES}", tirx.Broadcast(word, COLS))
        elif in_int32:
            m = xm.vload(m_at, "int16x16")
        else:  # pmaddwd by ones; the multiplier in float below
            m = tirx.Broadcast(tirx.const(1, "int16"), MULT_LANES)
        sums = [tirx.Cast("float32x8", half_sum(ct, xq, m, row, g, h)) for h in range(halves)]
        scales = [sc.vload([h * COLS], "float32x8") for h in range(halves)]
        offs = [
            sc.vload([(2 + h) * COLS], "float32x8") * tirx.Broadcast(xs[g * halves + h, row], COLS)
            for h in range(halves)
        ]
        if in_int32:
            return [s * c for s, c in zip(sums, scales, strict=True)], offs
        if group_major:  # `xm` is the float multiplier (int8_prefill_columns): a load
            mf = tirx.Broadcast(xm[g, row], COLS)
        else:
            mf = tirx.Broadcast(tirx.Cast("float32", xm[tuple(m_at)]), COLS)
        dots = sums[0] * scales[0]
        for s, c in zip(sums[1:], scales[1:], strict=True):
            dots = dots + s * c
        return [dots * mf], offs

    @T.macro
    def tile(w, n0, r0, rows, xq, xm, xr, xs, out, table=None):
        # stack arrays (not "local", see int8_ops.quantize_macro)
        acc = T.sblock_alloc_buffer((max_rows * COLS,), "float32")
        off = T.sblock_alloc_buffer((max_rows * COLS,), "float32")
        # transposed codes (signed: |code|, then the codes for their signs)
        ct = T.sblock_alloc_buffer(((2 if signed else 1) * STEPS * COLS,), "int32")
        sc = T.sblock_alloc_buffer((4 * COLS,), "float32")  # scales lo, hi; offsets lo, hi
        cb = T.sblock_alloc_buffer((COLS * LANES,), "int8")  # a lattice format's codes
        for i in T.unroll(max_rows):
            acc[T.Ramp(i * COLS, 1, COLS)] = T.Broadcast(T.float32(0), COLS)
            off[T.Ramp(i * COLS, 1, COLS)] = T.Broadcast(T.float32(0), COLS)
        for g in range(groups):
            # the next tile's weights (8 rows far apart: the hardware prefetchers do not
            # follow them, and the kernel waited on memory)
            for c in T.unroll(COLS):
                T.evaluate(prefetch_group(w, n0 + COLS + c, g))
            # a lattice format (its grid in `table`): each row's codes decoded once, into
            # `cb` (as expressions, the transpose would copy each row's grid lookups)
            if table is not None:
                for c in T.unroll(COLS):
                    cb[T.Ramp(c * LANES, 1, LANES)] = group(w, qtype, n0 + c, g, table).codes
            tr = T.meta_var(
                nibble_steps(w, n0, g, block_bytes, nibble_codes_at)
                if nibbles
                else transpose([stored32(cb, c) for c in range(COLS)])
                if table is not None
                else transpose([codes32(w, n0 + c, g) for c in range(COLS)])
            )
            if signed:  # the codes (for their signs) after their magnitudes
                store8(ct, STEPS * COLS, tr)
                store8(ct, 0, [magnitude32(v) for v in tr])
            elif view is not None:
                store8(ct, 0, [rebias(v) for v in tr])
            else:
                store8(ct, 0, tr)
            store_scales(sc, w, n0, g, table)
            if view is not None:  # codes (code + bias) >> shift: offset, then scale
                for h in T.unroll(halves):
                    sc[T.Ramp((2 + h) * COLS, 1, COLS)] = sc[T.Ramp((2 + h) * COLS, 1, COLS)] - (
                        sc[T.Ramp(h * COLS, 1, COLS)] * bias
                    )
                    sc[T.Ramp(h * COLS, 1, COLS)] = sc[T.Ramp(h * COLS, 1, COLS)] * step
            for r in range(rows):
                upd = T.meta_var(update(ct, sc, xq, xm, xs, r0 + r, g))
                acc[T.Ramp(r * COLS, 1, COLS)] = add_terms(acc[T.Ramp(r * COLS, 1, COLS)], upd[0])
                off[T.Ramp(r * COLS, 1, COLS)] = add_terms(off[T.Ramp(r * COLS, 1, COLS)], upd[1])
        for r in range(rows):
            out[r0 + r, 0, T.Ramp(n0, 1, COLS)] = (
                T.Broadcast(xr[r0 + r], COLS) * acc[T.Ramp(r * COLS, 1, COLS)]
                + off[T.Ramp(r * COLS, 1, COLS)]
            )

    return tile
