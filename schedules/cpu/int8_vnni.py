"""Batched decode column tiles for CPUs with AVX-512 VNNI: 16 output columns per vector.

The AVX2 column tiles of `int8_columns` spend, per sequence, group and 8 columns, a
`pmaddubsw` per 4-weight step, int16 adds across steps, a `pmaddwd` by the activations'
multiplier, a convert and an FMA: about 19 instructions. AVX-512 VNNI's `vpdpbusd` multiplies
unsigned bytes by signed bytes and adds each lane's 4 products straight into an int32
accumulator, and its activation operand can be a 32-bit word broadcast from memory. So here,
per sequence and group, 16 columns cost a `vpdpbusd` per step (8), and per scale block a
convert, a multiply and two FMAs (the weight scale times the group's activation step, then
the offset times the activation sum), into one float accumulator per sequence:

* a group's codes for 16 columns are transposed once per tile of up to 16 sequences, as
  two 8-column halves (`int8_columns.transpose` / `nibble_steps`) joined into 512-bit
  vectors: vector `s` holds weights `4s..4s+3` of each of the 16 columns;
* no int16 sums, so no bound on the codes: every format takes these tiles, q8_0 included
  (its signed codes are flipped to unsigned, `code + 128`, and the `-128 * d` goes to the
  offset, which multiplies the activation sum the quantize step already computes);
* the activations are quantized as for the other kernels (`int8_ops`), and a group's
  multiplier times the row's step is kept as one float per group (`steps`), which the
  weight scale multiplies: the result is the dot product of the same rounded activations.

Each group prefetches the same group of the next 16 rows, as the AVX2 tiles do (the rows are
a row apart in memory, which the hardware prefetchers do not follow).

The K-quants with one scale per group (q4k, q5k) walk super-blocks instead
(`int8_vnni_blocks`): a block's 8 scales and mins are decoded per row as vectors and
transposed once for the 16 columns, and q4k's codes, two groups' nibbles in the same 32
bytes, are transposed once per pair of groups (`Int8Codes.nibble_pairs_at`). 16 sequences,
weights from memory, one thread, CPU time, best of 7 interleaved rounds (shared machine,
load about 14), us per call: q4k 2048 -> 8192 2971 -> 2364, 8192 -> 2048 3005 -> 2528; q5k
4082 -> 3776, 4199 -> 4024 (scales only); q4_1 in the same rounds 2183 and 2274.

q5_0 and q5_1 (Q4_K_M's attention and FFN format where a row length is not a multiple of
256) transpose their nibble bytes as q4_0/q4_1 do and add each step's fifth bits from the
16 rows' 32-bit words (`fifth_bits_step`), instead of decoding 16 columns and transposing:
16 sequences, one thread, as above, q5_0 896 -> 9728 1916 -> 1252 us, 4864 -> 896 922 ->
588 (q4_1 1200 and 549), q5_1 1975 -> 1278, 953 -> 608.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from ..tir_common import STREAM, llvm_has_features, prefetch
from .int8_codes import LANES, codes_of, group
from .int8_columns import nibble_steps, scales_macro, transpose
from .int8_ops import offset_halves

COLS = 16  # output columns per vector (int32 / float32 lanes of a 512-bit register)
HALF = 8  # columns per 256-bit transpose
STEPS = LANES // 4  # 4-weight steps per group
ROWS = 16  # sequences per tile: the transposed codes are reused this many times
FEATURES = ("avx512f", "avx512bw", "avx512vnni")


def supported(target) -> bool:
    """Whether `target` (an x86 LLVM target) has the AVX-512 VNNI these tiles need."""
    return llvm_has_features(target, FEATURES)


def _c(i: int):
    return tirx.const(i, "int32")


def _join(lo, hi, lanes: int):
    """Two vectors of `lanes` lanes as one of twice as many (a 256-bit insert)."""
    return tirx.Shuffle([lo, hi], [_c(i) for i in range(2 * lanes)])


def _vpdpbusd(acc, codes, x):
    """acc (int32x16) plus, per lane, the 4 products of unsigned codes and signed bytes."""
    return T.call_llvm_pure_intrin(
        "int32x16",
        "llvm.x86.avx512.vpdpbusd.512",
        acc,
        tirx.reinterpret("uint8x64", codes),
        tirx.reinterpret("int8x64", x),
    )


def step_vectors(w, n0, g, qtype: str, stored=None):
    """8 int32x16: vector `s` holds unsigned codes `4s..4s+3` of group `g` of rows n0..n0+15
    (`stored`: a buffer holding the 16 rows' codes already, 32 bytes each: the lattice
    formats', whose decode expressions the transposes would copy many times over)."""
    block_bytes = get_format(qtype).type_size
    nibble_codes_at = codes_of(qtype).nibble_codes_at

    def half(first):
        if nibble_codes_at is not None:
            return nibble_steps(w, first, g, block_bytes, nibble_codes_at)
        if stored is not None:
            return transpose(
                [
                    tirx.reinterpret("int32x8", stored.vload([(first - n0 + c) * LANES], "int8x32"))
                    for c in range(HALF)
                ]
            )
        codes = [group(w, qtype, first + c, g).codes for c in range(HALF)]
        return transpose([tirx.reinterpret("int32x8", v) for v in codes])

    lo, hi = half(n0), half(n0 + HALF)
    steps = [_join(a, b, HALF) for a, b in zip(lo, hi, strict=True)]
    fifth_bits_at = codes_of(qtype).fifth_bits_at
    if fifth_bits_at is not None and nibble_codes_at is not None:
        words = [
            tirx.reinterpret("int32", w.vload([n0 + c, g * block_bytes + fifth_bits_at], "uint8x4"))
            for c in range(COLS)
        ]
        fifth = tirx.Shuffle(words, [_c(c) for c in range(COLS)])
        steps = [v | fifth_bits_step(fifth, s) for s, v in enumerate(steps)]
    if codes_of(qtype).signed:  # int8 codes as code + 128: flip each byte's sign bit
        flip = tirx.Broadcast(tirx.const(-0x7F7F7F80, "int32"), COLS)  # 0x80808080
        steps = [v ^ flip for v in steps]
    return steps


def fifth_bits_step(words, s: int):
    """int32x16: the fifth bits of weights 4s..4s+3 of 16 columns as 16 in their bytes, from
    each column's 32-bit word of fifth bits (bit j: weight j), in 3 vector instructions: a
    byte shuffle copies byte s // 2 of each word to its 4 bytes, a test against each byte's
    bit, a masked 16."""
    raw = tirx.reinterpret("uint8x64", words)
    spread = tirx.Shuffle([raw], [_c(4 * (i // 4) + s // 2) for i in range(4 * COLS)])
    byte_of_word = tirx.Cast("uint8x64", tirx.Ramp(_c(0), 1, 4 * COLS) % 4)
    masks = tirx.Broadcast(tirx.const(1 << (4 * (s % 2)), "uint8"), 4 * COLS) << byte_of_word
    bits = tirx.Select(
        (spread & masks) == masks,
        tirx.Broadcast(tirx.const(16, "uint8"), 4 * COLS),
        tirx.Broadcast(tirx.const(0, "uint8"), 4 * COLS),
    )
    return tirx.reinterpret("int32x16", bits)


@T.macro
def store_vectors(buf, vectors):
    """Eight 16-lane vectors (a Python list: codes of 8 steps, or 8 lanes' scales) into
    `buf[0:128]`; a macro, as TVMScript takes the list's items only by constant index."""
    buf[T.Ramp(0, 1, 16)] = vectors[0]
    buf[T.Ramp(16, 1, 16)] = vectors[1]
    buf[T.Ramp(32, 1, 16)] = vectors[2]
    buf[T.Ramp(48, 1, 16)] = vectors[3]
    buf[T.Ramp(64, 1, 16)] = vectors[4]
    buf[T.Ramp(80, 1, 16)] = vectors[5]
    buf[T.Ramp(96, 1, 16)] = vectors[6]
    buf[T.Ramp(112, 1, 16)] = vectors[7]


def tile_macro(qtype: str, groups: int, group_hook=None):
    """A macro: columns `n0..n0+15` for `rows` sequences from `r0`, the whole K.

    `group_hook`: a macro `(acc, g, ct, scale_of, offset_of, shift)` called for each group
    in place of the rows' updates, with the group's transposed codes `ct` (8 step vectors),
    the functions giving its 16 columns' scales and offsets per half, and what to add to
    each code byte first: weight = scale * (code + shift) + offset. AMX prefill's
    (`amx_prefill`) decodes the weights to bf16 with them; `acc` is then the caller's.

    Arguments: the weight buffer, `n0`, `r0`, `rows`, the int8 activations `xq` ([rows,
    groups, 32]), `steps` (float32 [rows, groups]: each group's multiplier times the row's
    step), the activation sums `xs` (as in `int8_ops`), then where the sums go: `acc[a0 + r,
    0, c0 : c0 + 16]` for row `r0 + r` (both callers pass a compact array of the tile's
    rows and copy it to `out`, whose rows alias in L1 at power-of-two widths).
    """
    halves = offset_halves(qtype)
    per_scale = STEPS // halves  # steps under one weight scale
    block_weights, block_bytes = get_format(qtype).block_size, get_format(qtype).type_size
    store_scales = scales_macro(qtype, COLS)
    block_scales = codes_of(qtype).block_scales

    def prefetch_group(w, n, g):
        """Prefetch about where group `g` of row `n` sits (the row clamped to the last one)."""
        byte = g * LANES * block_bytes // block_weights
        return prefetch(tirx.address_of(w[tirx.min(n, w.shape[0] - 1), byte]), STREAM)

    def broadcast(xq, row, g, s):
        """Activations 4s..4s+3 of the group, in every 32-bit lane (`xq` is [rows, groups,
        32]: a prefill tile's view puts a group's rows next to each other)."""
        word = tirx.reinterpret("int32", xq.vload([row, g, s * 4], "int8x4"))
        return tirx.Broadcast(word, COLS)

    def update(ct, scale_of, offset_of, xq, steps, xs, row, g):
        """This group's contribution to the 16 columns of sequence `row`; `scale_of(h)` and
        `offset_of(h)` are the 16 columns' scales and offsets of half `h` (float32x16)."""
        total = None
        for h in range(halves):
            # two accumulators, even and odd steps: half the chain of dependent vpdpbusd
            chains = [tirx.Broadcast(tirx.const(0, "int32"), COLS) for _ in range(2)]
            for s in range(h * per_scale, (h + 1) * per_scale):
                chains[s % 2] = _vpdpbusd(
                    chains[s % 2], ct.vload([s * COLS], "int32x16"), broadcast(xq, row, g, s)
                )
            dots = chains[0] + chains[1]
            scale = scale_of(h) * tirx.Broadcast(steps[row, g], COLS)
            offset = offset_of(h)
            term = tirx.Cast("float32x16", dots) * scale + offset * tirx.Broadcast(
                xs[g * halves + h, row], COLS
            )
            total = term if total is None else total + term
        return total

    # Formats with 16-weight halves (q2k, q6k) keep the per-group scales: transposing 16
    # scales and 16 offsets a block cost more than it saved (q6k 2048 x 8192, 16 sequences,
    # one thread: 4464 us per group, 5356 us per block)
    if block_scales is not None and halves == 1:
        from .int8_vnni_blocks import block_tile_macro  # (it imports this module)

        return block_tile_macro(qtype, groups, update, prefetch_group, group_hook)

    if codes_of(qtype).six_bit_at is not None:
        from .int8_vnni_sixbit import six_bit_tile_macro  # (it imports this module)

        return six_bit_tile_macro(qtype, groups, update, prefetch_group, store_scales, group_hook)

    def legacy_scale(sc):
        return lambda h: sc.vload([h * COLS], "float32x16")

    # signed codes are flipped to code + 128 (`step_vectors`): the offset takes -128 times
    # the scale, which a leading scale's `code_shift` holds already (q8_0, iq4_nl) and the
    # groups' own offsets do not (iq4_xs)
    flip_offset = codes_of(qtype).signed and codes_of(qtype).leading_scale is None

    def legacy_offset(sc):
        if flip_offset:
            return lambda h: (
                sc.vload([(2 + h) * COLS], "float32x16")
                + sc.vload([h * COLS], "float32x16")
                * tirx.Broadcast(tirx.const(-128.0, "float32"), COLS)
            )
        return lambda h: sc.vload([(2 + h) * COLS], "float32x16")

    def raw_offset(sc):
        return lambda h: sc.vload([(2 + h) * COLS], "float32x16")

    # what the hook adds to each code byte for the offsets `raw_offset` gives: -128 where
    # `legacy_offset` moves the flip into the offset (weight = scale * code + offset, the
    # large opposite terms of a flipped code and its offset rounded away; iq1_s's offset)
    raw_shift = -128 if flip_offset else 0

    @T.macro
    def tile(w, n0, r0, rows, xq, steps, xs, acc, a0, c0, table=None):
        # the sums accumulate in the caller's `acc`, so a tile takes any number of rows: a
        # stack array of its own stops at 1 KiB (16 x 16 floats), past which TVM calls its
        # workspace allocator
        ct = T.sblock_alloc_buffer((STEPS * COLS,), "int32")  # transposed codes
        sc = T.sblock_alloc_buffer((4 * COLS,), "float32")  # scales lo, hi; offsets lo, hi
        cb = T.sblock_alloc_buffer((COLS * LANES,), "int8")  # a lattice format's codes
        if group_hook is None:
            for r in range(rows):
                acc[a0 + r, 0, T.Ramp(c0, 1, COLS)] = T.Broadcast(T.float32(0), COLS)
        for g in range(groups):
            for c in T.unroll(COLS):
                T.evaluate(prefetch_group(w, n0 + COLS + c, g))
            if table is not None:  # a lattice format: each row's codes decoded once
                for c in T.unroll(COLS):
                    cb[T.Ramp(c * LANES, 1, LANES)] = group(w, qtype, n0 + c, g, table).codes
            tr = T.meta_var(step_vectors(w, n0, g, qtype, None if table is None else cb))
            store_vectors(ct, tr)
            store_scales(sc, w, n0, g, table)
            if group_hook is not None:  # (signed codes un-flipped: exact weights)
                group_hook(acc, g, ct, legacy_scale(sc), raw_offset(sc), raw_shift)
            else:
                for r in range(rows):
                    upd = T.meta_var(
                        update(ct, legacy_scale(sc), legacy_offset(sc), xq, steps, xs, r0 + r, g)
                    )
                    acc[a0 + r, 0, T.Ramp(c0, 1, COLS)] = acc[a0 + r, 0, T.Ramp(c0, 1, COLS)] + upd

    return tile
