"""`decode`'s one-row int8 kernel for CPUs with AVX-512 VNNI: two groups per `vpdpbusd`.

The AVX2 row kernel of `int8_gemv` spends, per 32-weight group, a `pmaddubsw`, a `pmaddwd` by
the activations' multiplier `m`, a convert and an FMA with a scale broadcast to 8 lanes (plus
q8_0's sign trick): on 256-bit vectors, about 6 vector instructions per 32 weights besides
the codes' unpacking. Here two groups' codes are joined in one 512-bit vector and a single
`vpdpbusd` multiplies their 64 unsigned codes by the 64 int8 activations, summing each lane's
4 products straight to int32 (no int16 stage, so q8_0's signed codes just flip to
`code + 128`, the `-128 * d` joining the offsets, as in `int8_vnni`). `m` moves from the
integer product into the float scale: per pair of groups one 16-lane vector holds each
lane's weight scale times its group's `m` (`xmf`, kept as float per scale slot by the
quantize step), and one convert and one FMA take the pair into a 16-lane accumulator. The
K-quants multiply a super-block's decoded scales (`Int8Codes.block_scales`) by `xmf` once
per block and pick each pair's 16 lanes from that with one permute.

Numerics: the same dot product of the dequantized weights with the same rounded activations;
only where `m` meets the sum differs (a float product instead of an int32 one), a float32
rounding within the tests' bound.

Also: q4k's pairs are the low and the high nibbles of one 64-byte load (groups 4i, 4i+2 and
4i+1, 4i+3: the activations are copied once per call into that order, `xp`), two super-blocks'
scales decode as one 16-lane vector, and the K-quants prefetch the row 4 KiB ahead (the
hardware prefetchers alone left the q6k head at 15-17 GB/s cold against 28 in cache).

Prefetching, since 2026-12-02: 16 KiB ahead and into L2 only (`prefetcht2`, `STREAM`), and
the formats of `int8_vnni_legacy` too (a row's lines when the row starts). On an Intel Xeon
with AVX-512 VNNI (2 cores of a VM) one core reads only 9-11 GB/s through these kernels
while a plain numpy stream gets 14: with `prefetcht0` every request holds one of the core's
few L1 fill buffers until the line comes, which caps the lines in flight. Two threads, GB/s,
4 KiB `prefetcht0` (legacy: none) -> 16 KiB `prefetcht2`, interleaved: q4k 16384 x 2048 17.0
-> 19.7, q6k head 17.5 -> 22, q6k 2048 x 8192 16.3 -> 23.5, q8_0 head 23.5 -> 25.9, q4_1
1536 x 576 11 -> 16.9; Llama-3.2-1B's decode step 52-54 -> 41-42 ms, Qwen2.5-0.5B's 28.4-28.9
-> 23.5-24.5, SmolLM2's 9.6-10.0 -> 6.4-7.7 (`benchmarks/decode_profile.py`). 64 KiB ahead
measured the same as 16 in a model's step; `prefetcht2` for the attention's KV pages and
the batched tiles' rows changed nothing measurable (kept: t0 in attention, t2 in the tiles).
Then two memory streams per task (`int8_ops.STREAMS`: a task's rows alternate between the first and
the second half of the weight, so each core follows two address streams): Llama-3.2-1B's
step, 7 interleaved rounds, 39.8-44.9 (median 41.5) -> 37.2-38.6 ms (37.7; one outlier at
48.8 left out); four streams 38.0-40.6.
Then 16 KiB -> 4 KiB ahead (2026-12-07), once the weights of 3B-class models came from memory:
two threads, cold, percent of a numpy stream in the same run (29.3 GB/s), 16 KiB -> 4 KiB:
q4k 16384 x 3072 77 -> 85, q4k 3072 x 8192 70 -> 77, q6k 3072 x 8192 73 -> 79, q6k 128256 x
3072 79 -> 85 (2 KiB as 4); the AVX2 kernels likewise (q4k 3072 x 8192 69-72 -> 77-78).
Llama-3.2-3B Q4_K_M's step, 3 interleaved rounds: 85.9 / 86.6 / 89.0 -> 85.3 / 84.3 / 87.2 ms;
on a later VM with faster memory the same A/B measured 65.5-67.0 against 65.9-66.0 ms.

Instructions per super-block in q4k's inner loop: 80 (AVX2) -> 62 (pairs) -> 50 (64-byte
loads) -> 44 (two blocks' scales); then the two blocks' d and dmin converted as one vector
took the two-block step (prefetches and loop control counted) from 95 to 85
(docs/benchmarks.md has the later figures). Weights from memory, one thread, CPU time, best
of 7-11 interleaved rounds (`benchmarks/gemv_bandwidth.py`; shared machine, load 7-10, so
+-20%), GB/s of weight bytes, AVX2 row kernel -> this one: q4k 16384 x 2048 13.7 ->
17.6-19.6, q4k 2048 x 8192 17.9 -> 20.4 (one run: 14.4 both); q6k 128256 x 2048 (Llama 3.2's
head) 15.8-17.1 -> 19.5-22.3; q8_0 151936 x 896 (Qwen2.5's head) 13.7-19.6 -> 19.6-25.6;
q5_0 9728 x 896 10.1-11.1 -> 12.3-13.4. In cache (1 MB, one thread) q4k runs at 22 GB/s, q6k
28, q8_0 37, q5_0 14: q4k and q5_0 are bound by instructions, the others by memory.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from ..tir_common import STREAM, add, prefetch, reduce_lanes
from . import int8_table_row, int8_vnni_legacy
from .int8_codes import LANES, Row, codes_of, group
from .int8_ops import (
    AHEAD,
    MULT_LANES,
    N_CHUNK,
    offset_halves,
    quantize_macro,
    row_streams,
    streamed_row,
)
from .int8_vnni import COLS, _vpdpbusd

PAIR = 2 * LANES  # weights per vpdpbusd: two groups
HALF = LANES // 2  # activations reordered together


def _c(i: int):
    return tirx.const(i, "int32")


def applies(qtype: str, k: int) -> bool:
    """Whether rows of length `k` split into whole pairs of groups (else the AVX2 kernel)."""
    return k % PAIR == 0 and get_format(qtype).block_size % PAIR in (0, LANES)


def pair_codes(w, qtype: str, n, g):
    """uint8x64: the codes of groups g and g + 1 of row n, as `vpdpbusd`'s unsigned operand."""
    lo, hi = group(w, qtype, n, g).codes, group(w, qtype, n, g + 1).codes
    joined = tirx.Shuffle([lo, hi], [_c(i) for i in range(PAIR)])
    if codes_of(qtype).signed:  # int8 codes as code + 128: flip each byte's sign bit
        return tirx.reinterpret("uint8x64", joined) ^ tirx.Broadcast(
            tirx.const(0x80, "uint8"), PAIR
        )
    return tirx.reinterpret("uint8x64", joined)


def spread(scales, slots: int):
    """float32x16 from `slots` scales (2 groups x halves): lane i covers weights 4i..4i+3."""
    per = COLS // slots
    # (a shuffle gives at most as many lanes as its inputs hold)
    return tirx.Shuffle([scales] * per, [_c(i // per) for i in range(COLS)])


def row_kernel(qtype: str, n_out: int, k: int, ahead: int = AHEAD, vnni: bool = True):
    """`out[0, 0, :] = x[0, 0, :] @ dequantize(w)^T`, one sequence (see the module doc).
    `vnni=False`: the AVX2 dot product of the table formats (`int8_table_row`) in the same
    scaffold, for them only."""
    fmt = get_format(qtype)
    groups = k // LANES
    rb = fmt.row_bytes(k)
    halves = offset_halves(qtype)
    slots = groups * halves
    quantize = quantize_macro(groups, halves)
    padded = -(-slots // int8_vnni_legacy.CHUNK) * int8_vnni_legacy.CHUNK  # vector tail reads
    nibble_pairs = codes_of(qtype).nibble_pairs_at is not None and fmt.block_size % 256 == 0

    table = int8_table_row.applies(qtype)
    if not vnni and not table:
        raise ValueError(f"{qtype}: only the table formats take this scaffold on AVX2")
    load = int8_table_row.LOAD if vnni else int8_table_row.AVX2_LOAD

    def source_chunk(c):
        """The 16 activations (of `xq`) that go to chunk `c` of `xp`: q4k's pairs are groups
        4i, 4i+2 and 4i+1, 4i+3 of each block (the low and the high nibbles of one 64-byte
        load); the table formats' order is `int8_table_row.source_chunk`'s."""
        if table:
            return int8_table_row.source_chunk(c, load)
        if not nibble_pairs:
            return c
        g = c // 2
        return (g // 4 * 4 + g % 2 * 2 + g // 2 % 2) * 2 + c % 2

    streams = row_streams(n_out)
    # the K-quants' loop prefetches as it goes; the others ask for a row's lines up front
    row_lines = 0
    if table and not vnni:
        dot_row = int8_table_row.avx2_dot_macro(qtype, groups, ahead)
    elif table:
        dot_row = int8_table_row.dot_macro(qtype, groups, ahead)
    elif int8_vnni_legacy.applies(qtype):
        dot_row = int8_vnni_legacy.dot_macro(qtype, groups, pair_codes)
        row_lines = -(-rb // 64) if ahead else 0
    elif codes_of(qtype).block_scales is not None and fmt.block_size % PAIR == 0:
        dot_row = _block_dot_macro(qtype, groups, halves, ahead)
    else:
        dot_row = _pair_dot_macro(qtype, groups, halves)

    @T.prim_func(s_tir=True, private=True)
    def gemv(
        x: T.Buffer((1, 1, k), "float32"),
        w: T.Buffer((n_out, rb), "uint8"),
        out: T.Buffer((1, 1, n_out), "float32"),
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        xq = T.sblock_alloc_buffer((1, k), "int8")
        xp = T.sblock_alloc_buffer((1, k), "int8")  # xq's groups in the kernel's pair order
        xm = T.sblock_alloc_buffer((1, groups * MULT_LANES), "int16")
        xr = T.sblock_alloc_buffer((1,), "float32")
        xs = T.sblock_alloc_buffer((slots, 1), "float32")
        sums = T.sblock_alloc_buffer((padded,), "float32")  # xs, for vector loads
        xmf = T.sblock_alloc_buffer((padded,), "float32")  # m per scale slot, as float
        with T.sblock("quantize"):
            T.reads(x[0, 0, 0:k])
            T.writes(xq[0, 0:k], xp[0, 0:k], xm[0, :], xr[0], xs[:, 0], sums[:], xmf[:])
            quantize(x, 0, xq, xm, xr, xs)
            for c in range(k // HALF):
                src: T.let[T.int32] = source_chunk(c)
                xp[0, T.Ramp(c * HALF, 1, HALF)] = xq[0, T.Ramp(src * HALF, 1, HALF)]
            for i in range(slots):
                sums[i] = xs[i, 0]
                xmf[i] = T.Cast("float32", xm[0, i // halves * MULT_LANES])
            for i in range(padded - slots):
                sums[slots + i] = T.float32(0)
                xmf[slots + i] = T.float32(0)
        for nc in T.parallel(n_out // N_CHUNK // streams):
            for ni, si in T.grid(N_CHUNK, streams):
                with T.sblock("dot"):
                    row = T.meta_var(streamed_row(nc, ni, si, n_out, streams))
                    T.reads(w[row, 0:rb], xp[0, :], xr[0], sums[:], xmf[:])
                    T.writes(out[0, 0, row])
                    for j in T.unroll(row_lines):
                        T.evaluate(prefetch(T.address_of(w[row, j * 64 + ahead]), STREAM))
                    dot_row(w, row, xp, xr, sums, xmf, out)

    return gemv


def _block_dot_macro(qtype: str, groups: int, halves: int, ahead: int):
    """Row `n` of a K-quant: per super-block, its scales times `xmf` once, then per pair a
    permute, a `vpdpbusd`, a convert and an FMA; the offsets in one vector FMA per block."""
    fmt = get_format(qtype)
    per_block = fmt.block_size // LANES
    blocks = groups // per_block
    width = per_block * halves
    block_scales = codes_of(qtype).block_scales

    lines = (2 * fmt.type_size + 63) // 64 if ahead else 0  # per step, at most 2 blocks

    def prefetch_ahead(w, n, byte):
        return prefetch(tirx.address_of(w[n, byte + ahead]), STREAM)

    # two super-blocks a step where the row has an even number: their scales decode as one
    # vector of twice the lanes (q4k: 16-lane instructions instead of two 8-lane runs)
    step = 2 if blocks % 2 == 0 else 1
    sw = width * step  # scale lanes per step
    pairs = step * per_block // 2

    def row_scales(w, n, b):
        return block_scales(*[Row(w, n, (b * step + i) * fmt.type_size) for i in range(step)])

    pairs_at = codes_of(qtype).nibble_pairs_at if fmt.block_size % 256 == 0 else None

    def pair_scales(ss, p):
        if pairs_at is not None:  # groups 4i + j and 4i + j + 2 (j = p % 2, i = p // 2)
            return spread(ss[T.Ramp(p // 2 * 4 + p % 2, 2, 2)], 2)
        return spread(ss[T.Ramp(p * 2 * halves, 1, 2 * halves)], 2 * halves)

    def codes(w, n, b, p):
        if pairs_at is not None:  # one 64-byte load: low nibbles, or high, of 4 runs of 32
            v = w.vload([n, b * fmt.type_size + pairs_at + p // 2 * 64], "uint8x64")
            return (v >> tirx.Broadcast(tirx.Cast("uint8", p % 2 * 4), PAIR)) & tirx.Broadcast(
                tirx.const(15, "uint8"), PAIR
            )
        return pair_codes(w, qtype, n, b * per_block + p * 2)

    @T.macro
    def dot_row(w, n, xq, xr, sums, xmf, out):
        # stack arrays (see int8_ops.quantize_macro): two 16-lane chains, offsets, scales
        acc = T.sblock_alloc_buffer((2 * COLS,), "float32")
        off = T.sblock_alloc_buffer((sw,), "float32")
        ss = T.sblock_alloc_buffer((sw,), "float32")
        acc[T.Ramp(0, 1, 2 * COLS)] = T.Broadcast(T.float32(0), 2 * COLS)
        off[T.Ramp(0, 1, sw)] = T.Broadcast(T.float32(0), sw)
        for b in range(blocks // step):
            for j in T.unroll(lines * step // 2):
                T.evaluate(prefetch_ahead(w, n, b * step * fmt.type_size + j * 64))
            scales = T.meta_var(row_scales(w, n, b))
            ss[T.Ramp(0, 1, sw)] = scales[0] * xmf[T.Ramp(b * sw, 1, sw)]
            off[T.Ramp(0, 1, sw)] = off[T.Ramp(0, 1, sw)] + scales[1] * sums[T.Ramp(b * sw, 1, sw)]
            for p in T.unroll(pairs):
                g: T.let[T.int32] = b * step * per_block + p * 2
                dots: T.let[T.int32x16] = _vpdpbusd(
                    T.Broadcast(T.int32(0), COLS),
                    codes(w, n, b * step + p // (per_block // 2), p % (per_block // 2)),
                    xq.vload([0, g * LANES], "int8x64"),
                )
                acc[T.Ramp(p % 2 * COLS, 1, COLS)] = acc[T.Ramp(p % 2 * COLS, 1, COLS)] + T.Cast(
                    "float32x16", dots
                ) * pair_scales(ss, p)
        out[0, 0, n] = xr[0] * reduce_lanes(
            acc[T.Ramp(0, 1, COLS)] + acc[T.Ramp(COLS, 1, COLS)], COLS, add
        ) + reduce_lanes(off[T.Ramp(0, 1, sw)], sw, add)

    return dot_row


def _pair_dot_macro(qtype: str, groups: int, halves: int):
    """Row `n` of a 32-weight-block format (or a K-quant without vector block scales): per
    pair of groups their scales (times `xmf`) spread to 16 lanes, a `vpdpbusd`, a convert and
    an FMA; the offsets as scalar FMAs on two chains."""
    signed = codes_of(qtype).signed
    pairs = groups // 2
    slots = 2 * halves  # scales per pair

    def pair_scales(w, n, g, xmf):
        parts = []
        for j in range(2):
            grp = group(w, qtype, n, g + j)
            parts += [grp.scale_lo, grp.scale_hi][:halves]
        vec = tirx.Shuffle([tirx.Broadcast(s, 2) for s in parts], [_c(2 * i) for i in range(slots)])
        return spread(vec * xmf[T.Ramp(g * halves, 1, slots)], slots)

    def pair_offset(w, n, g, sums):
        total = None
        for j in range(2):
            grp = group(w, qtype, n, g + j)
            if signed:  # code + 128: the shift times each half's scale
                terms = [(grp.scale_lo * -128.0, 0), (grp.scale_hi * -128.0, 1)][:halves]
            else:
                terms = [(grp.offset_lo, 0), (grp.offset_hi, 1)][:halves]
            for o, h in terms:
                t = o * sums[(g + j) * halves + h]
                total = t if total is None else total + t
        return total

    @T.macro
    def dot_row(w, n, xq, xr, sums, xmf, out):
        acc = T.sblock_alloc_buffer((2 * COLS,), "float32")
        off = T.sblock_alloc_buffer((2,), "float32")
        acc[T.Ramp(0, 1, 2 * COLS)] = T.Broadcast(T.float32(0), 2 * COLS)
        off[0] = T.float32(0)
        off[1] = T.float32(0)
        for pu in range(pairs // 2):
            for u in T.unroll(2):
                g: T.let[T.int32] = (pu * 2 + u) * 2
                dots: T.let[T.int32x16] = _vpdpbusd(
                    T.Broadcast(T.int32(0), COLS),
                    pair_codes(w, qtype, n, g),
                    xq.vload([0, g * LANES], "int8x64"),
                )
                acc[T.Ramp(u * COLS, 1, COLS)] = acc[T.Ramp(u * COLS, 1, COLS)] + T.Cast(
                    "float32x16", dots
                ) * pair_scales(w, n, g, xmf)
                off[u] = off[u] + pair_offset(w, n, g, sums)
        if pairs % 2 == 1:
            gl: T.let[T.int32] = (pairs - 1) * 2
            last: T.let[T.int32x16] = _vpdpbusd(
                T.Broadcast(T.int32(0), COLS),
                pair_codes(w, qtype, n, gl),
                xq.vload([0, gl * LANES], "int8x64"),
            )
            acc[T.Ramp(0, 1, COLS)] = acc[T.Ramp(0, 1, COLS)] + T.Cast(
                "float32x16", last
            ) * pair_scales(w, n, gl, xmf)
            off[0] = off[0] + pair_offset(w, n, gl, sums)
        out[0, 0, n] = (
            xr[0] * reduce_lanes(acc[T.Ramp(0, 1, COLS)] + acc[T.Ramp(COLS, 1, COLS)], COLS, add)
            + off[0]
            + off[1]
        )

    return dot_row
