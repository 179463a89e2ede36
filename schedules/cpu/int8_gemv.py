"""Decode matrix-vector kernels for quantized weights: int8 activations, integer dot products.

What llama.cpp does on x86, as TensorIR: the activation row is quantized to int8 in groups
of 32 (Q8_0's rule, with each group's scale kept as an int16 multiple of a step per row
and the codes rounded against it: see `int8_ops`), then every 32-weight group of a row
costs one `pmaddubsw` (32 unsigned weight codes times 32 int8 activations, pairwise summed to
16 int16), one `pmaddwd` (to 8 int32, times the activations' multiplier), one convert and one
FMA with the weight scale into 8 float partial sums; the row's step multiplies the total once.
The formats' offsets (mins, the `-8` of q4_0, ...) multiply the group's activation sum, which
the quantize step computes once. See `int8_codes` for how each format becomes codes.

Compared with the float schedule of `quant` (decode each weight to float, then an FMA:
about one instruction per weight), this is about half an instruction per weight; SmolLM2's
q4_1 gate/up projection went from 0.35 to 0.14 ms.

Numerics: the result is the exact dot product of the dequantized weights with the rounded
activations, up to float32 summation order; tests compare it with
`gguf.quants.dequantize(W)` times the activations rounded by `int8_ops`'s rule, written
again in numpy. Only decode uses it
(one token per sequence); prefill keeps float activations (`tiled`), as its weights are
decoded once per tile of tokens and it is not bound by the per-weight decode cost.

Memory access as in the VNNI row kernels (`int8_ops.AHEAD`, `STREAMS`): each row's lines
asked for `AHEAD` bytes early into L2, a task's rows taken from two regions of the weight in
turn. (The figures below are from 16 KiB ahead; 4 KiB since 2026-12-07, `int8_vnni_row`.)
Without it the AVX2 kernels relied on the hardware prefetchers alone. On an Intel Xeon with
AVX-512 (2 cores of a VM) running these AVX2 kernels, two threads, weights from memory
(1.6 GB of copies), best of 5 interleaved rounds, GB/s before -> after: q4k 28672 x 4096
8.3 -> 20.7, q4k 4096 x 14336 10.7 -> 18.7, q5k 8192 x 3072 8.5 -> 19.6, q4_0 8192 x 4096
6.9 -> 13.6, q8_0 4096 x 4096 16.6 -> 18.8, q6k 4096 x 14336 19.8 -> 20.0 (numpy stream
31.7); a Llama-3.2-3B Q4_K_M artifact built `--cpu x86-64-v3` decodes at 9.19 tok/s
against 4.53 on that Xeon. Not measured on an AVX2-only CPU (an AMD Zen 3's prefetchers got
55% of its stream without it: docs/benchmarks.md).

Needs AVX2 (`pmaddubsw`, `pmaddwd`, `psignb` on 256-bit vectors); `supported(target)` says.
Batches on CPUs with AVX-512 VNNI go to `int8_vnni`'s tiles (`vnni=True`).
"""

from __future__ import annotations

from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from ..tir_common import STREAM, add, prefetch, reduce_lanes
from . import int8_grid_row, int8_kquant_row, int8_table_row, int8_vnni_row
from .int8_codes import LANES, Row, codes_of, group, has_table
from .int8_ops import (
    AHEAD,
    MULT_LANES,
    N_CHUNK,
    code_type,
    dot,
    lane_scales,
    offset_halves,
    quantize_macro,
    row_streams,
    streamed_row,
    sum_lanes,
)


def supported(target) -> bool:
    """Whether `target` is an x86 CPU with AVX2."""
    from tvm.target import codegen

    if target is None or target.kind.name != "llvm":
        return False
    triple = str(target.attrs.get("mtriple", "") or "")
    if triple and not triple.startswith(("x86_64", "i686")):
        return False
    try:
        return bool(codegen.target_has_features("avx2", target))
    except Exception:  # noqa: BLE001 - an LLVM without x86 support has no such features
        return False


def gemv_kernel(
    qtype: str,
    n_out: int,
    k: int,
    batch: int | None,
    column_tiles: bool = True,
    vnni: bool = False,
):
    """`out[b, 0, :] = x[b, 0, :] @ dequantize(w)^T` for `qtype` weights [n_out, k].

    `batch` is the static number of sequences, or None for a symbolic one (`batch_decode`).
    Same parameters as the `quant_matmul` PrimFunc it replaces: (x, w, out). One sequence
    gets the kernel below (`int8_vnni_row`'s where `vnni`: the target has AVX-512 VNNI);
    more get the tiled kernel of `int8_batched`, whose column tiles (`int8_columns`, or
    `int8_vnni` where `vnni`) `column_tiles=False` turns off (benchmarks, tests).
    """
    if k % LANES or n_out % N_CHUNK:
        raise ValueError(f"int8 gemv needs k % {LANES} == 0 and n % {N_CHUNK} == 0")
    if batch != 1:
        from .int8_batched import batched_kernel

        return batched_kernel(qtype, n_out, k, batch, column_tiles, vnni)
    if int8_grid_row.applies(qtype, k):
        return int8_grid_row.row_kernel(qtype, n_out, k, vnni)
    if vnni and int8_vnni_row.applies(qtype, k) and not has_table(qtype):
        return int8_vnni_row.row_kernel(qtype, n_out, k)
    if int8_table_row.applies(qtype) and int8_vnni_row.applies(qtype, k):
        return int8_vnni_row.row_kernel(qtype, n_out, k, vnni=False)
    if int8_kquant_row.applies(qtype, k):
        return int8_kquant_row.row_kernel(qtype, n_out, k)
    if codes_of(qtype).block_scales is not None:
        return _block_row_kernel(qtype, n_out, k)
    return _row_kernel(qtype, n_out, k)


def _row_kernel(qtype: str, n_out: int, k: int):
    groups = k // LANES
    rb = get_format(qtype).row_bytes(k)
    signed = codes_of(qtype).signed
    halves = offset_halves(qtype)
    # two independent accumulator chains (even and odd groups) hide the FMA latency that
    # otherwise bounds the loop
    chains = 2 if groups % 2 == 0 else 1
    # K-quants: a whole super-block per iteration, so its scale bytes are loaded once
    unroll = max(get_format(qtype).block_size // LANES, chains)
    quantize = quantize_macro(groups, halves)
    streams = row_streams(n_out)
    lines = -(-rb // 64)

    @T.macro
    def row_dot(x, w, out, table):
        xq = T.sblock_alloc_buffer((1, k), "int8")
        xm = T.sblock_alloc_buffer((1, groups * MULT_LANES), "int16")
        xr = T.sblock_alloc_buffer((1,), "float32")
        xs = T.sblock_alloc_buffer((groups * halves, 1), "float32")
        with T.sblock("quantize"):
            T.reads(x[0, 0, 0:k])
            T.writes(xq[0, 0:k], xm[0, 0 : groups * MULT_LANES], xr[0], xs[:, 0])
            quantize(x, 0, xq, xm, xr, xs)
        for nc in T.parallel(n_out // N_CHUNK // streams):
            for ni, si in T.grid(N_CHUNK, streams):
                with T.sblock("dot"):
                    n = T.meta_var(streamed_row(nc, ni, si, n_out, streams))
                    T.reads(w[n, 0:rb], xq[0, :], xm[0, :], xr[0], xs[:, 0])
                    T.writes(out[0, 0, n])
                    for j in T.unroll(lines):  # the row's lines, `AHEAD` bytes early
                        T.evaluate(prefetch(T.address_of(w[n, j * 64 + AHEAD]), STREAM))
                    # stack arrays, not "local" (see int8_ops.quantize_macro)
                    acc = T.sblock_alloc_buffer((chains * 8,), "float32")
                    off = T.sblock_alloc_buffer((chains,), "float32")
                    for a in T.unroll(chains):
                        acc[T.Ramp(a * 8, 1, 8)] = T.Broadcast(T.float32(0), 8)
                        off[a] = T.float32(0)
                    for gu in range(groups // unroll):
                        for u in T.unroll(unroll):
                            g: T.let[T.int32] = gu * unroll + u
                            a: T.let[T.int32] = u % chains
                            # (TVMScript binds expressions only: one field per call)
                            codes: T.let[code_type(qtype)] = group(w, qtype, n, g, table).codes
                            s_lo: T.let[T.float32] = group(w, qtype, n, g, table).scale_lo
                            s_hi: T.let[T.float32] = group(w, qtype, n, g, table).scale_hi
                            o_lo: T.let[T.float32] = group(w, qtype, n, g, table).offset_lo
                            o_hi: T.let[T.float32] = group(w, qtype, n, g, table).offset_hi
                            sums: T.let[T.int32x8] = dot(
                                codes,
                                xq.vload([0, g * LANES], "int8x32"),
                                xm.vload([0, g * MULT_LANES], "int16x16"),
                                signed,
                            )
                            acc[T.Ramp(a * 8, 1, 8)] = acc[T.Ramp(a * 8, 1, 8)] + T.Cast(
                                "float32x8", sums
                            ) * lane_scales(s_lo, s_hi)
                            # one add on the loop-carried chain, the products off it
                            off[a] = off[a] + _offset(xs, g, o_lo, o_hi, halves)
                    if chains == 2:
                        out[0, 0, n] = (
                            xr[0] * (sum_lanes(acc, 0) + sum_lanes(acc, 1)) + off[0] + off[1]
                        )
                    else:
                        out[0, 0, n] = xr[0] * sum_lanes(acc, 0) + off[0]

    if get_format(qtype).table is not None:
        return _with_table(qtype, n_out, k, rb, row_dot)

    @T.prim_func(s_tir=True, private=True)
    def gemv(
        x: T.Buffer((1, 1, k), "float32"),
        w: T.Buffer((n_out, rb), "uint8"),
        out: T.Buffer((1, 1, n_out), "float32"),
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        row_dot(x, w, out, None)

    return gemv


def _with_table(qtype: str, n_out: int, k: int, rb: int, row_dot):
    """The one-row kernel of a format with a constant table: the parameters of the fused
    `quant_matmul` it replaces, (x, w, table, out) (`model_defs.quant_ops`)."""
    size = len(get_format(qtype).table())

    @T.prim_func(s_tir=True, private=True)
    def gemv(
        x: T.Buffer((1, 1, k), "float32"),
        w: T.Buffer((n_out, rb), "uint8"),
        table: T.Buffer((size,), "uint8"),
        out: T.Buffer((1, 1, n_out), "float32"),
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        row_dot(x, w, out, table)

    return gemv


def _block_row_kernel(qtype: str, n_out: int, k: int):
    """The one-row kernel for the K-quants with float group scales (q2k, q6k; q4k and q5k
    take `int8_kquant_row`'s integer ones): a super-block's scales and offsets are decoded
    once, as vectors (`Int8Codes.block_scales`), and its offsets meet the activation sums
    in one vector FMA; each group then only broadcasts its scale from a stack array.

    Decoding each group's 6-bit scale and min with scalar byte arithmetic (`_row_kernel`)
    cost about as much as the group's dot product. Weights from memory, one thread, CPU
    time, best of 9 interleaved rounds (shared machine, load average about 12), us per
    call, before -> after: q4k 4864 -> 896 170 -> 141, 2048 -> 8192 842 -> 727, 8192 ->
    2048 641 -> 557; q6k 269 -> 210, 1191 -> 865, 956 -> 700; q5k 258 -> 186, 794 -> 720,
    719 -> 628. q4_1 in the same rounds: 156, 809, 624, so per weight the K-quants now
    cost what q4_1 does or less (q4k reads 10% fewer bytes).
    """
    fmt = get_format(qtype)
    groups = k // LANES
    per_block = fmt.block_size // LANES
    blocks = groups // per_block
    rb = fmt.row_bytes(k)
    signed = codes_of(qtype).signed
    halves = offset_halves(qtype)
    width = per_block * halves  # scales per super-block: lanes of the block_scales vectors
    block_scales = codes_of(qtype).block_scales
    quantize = quantize_macro(groups, halves)
    streams = row_streams(n_out)
    ts = fmt.type_size
    lines = -(-ts // 64)  # per super-block (the next block's lines cover a straddled one)

    def row_scales(w, n, b):
        return block_scales(Row(w, n, b * fmt.type_size))

    def group_scales(ss, u):
        """8 lanes of group `u`'s scales: 4 for each half (`int8_ops.lane_scales`)."""
        if halves == 1:
            return T.Broadcast(ss[u], 8)
        return lane_scales(ss[u * 2], ss[u * 2 + 1])

    @T.prim_func(s_tir=True, private=True)
    def gemv(
        x: T.Buffer((1, 1, k), "float32"),
        w: T.Buffer((n_out, rb), "uint8"),
        out: T.Buffer((1, 1, n_out), "float32"),
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        xq = T.sblock_alloc_buffer((1, k), "int8")
        xm = T.sblock_alloc_buffer((1, groups * MULT_LANES), "int16")
        xr = T.sblock_alloc_buffer((1,), "float32")
        xs = T.sblock_alloc_buffer((groups * halves, 1), "float32")
        sums = T.sblock_alloc_buffer((groups * halves,), "float32")  # xs, for vector loads
        with T.sblock("quantize"):
            T.reads(x[0, 0, 0:k])
            T.writes(xq[0, 0:k], xm[0, 0 : groups * MULT_LANES], xr[0], xs[:, 0], sums[:])
            quantize(x, 0, xq, xm, xr, xs)
            for i in range(groups * halves):
                sums[i] = xs[i, 0]
        for nc in T.parallel(n_out // N_CHUNK // streams):
            for ni, si in T.grid(N_CHUNK, streams):
                with T.sblock("dot"):
                    n = T.meta_var(streamed_row(nc, ni, si, n_out, streams))
                    T.reads(w[n, 0:rb], xq[0, :], xm[0, :], xr[0], sums[:])
                    T.writes(out[0, 0, n])
                    # stack arrays (see int8_ops.quantize_macro): two 8-lane chains of
                    # dot products, the offsets' lanes, the block's scales
                    acc = T.sblock_alloc_buffer((16,), "float32")
                    off = T.sblock_alloc_buffer((width,), "float32")
                    ss = T.sblock_alloc_buffer((width,), "float32")
                    acc[T.Ramp(0, 1, 16)] = T.Broadcast(T.float32(0), 16)
                    off[T.Ramp(0, 1, width)] = T.Broadcast(T.float32(0), width)
                    for b in range(blocks):
                        for j in T.unroll(lines):  # the block's lines, `AHEAD` bytes early
                            T.evaluate(
                                prefetch(T.address_of(w[n, b * ts + j * 64 + AHEAD]), STREAM)
                            )
                        scales = T.meta_var(row_scales(w, n, b))
                        ss[T.Ramp(0, 1, width)] = scales[0]
                        off[T.Ramp(0, 1, width)] = (
                            off[T.Ramp(0, 1, width)] + scales[1] * sums[T.Ramp(b * width, 1, width)]
                        )
                        for u in T.unroll(per_block):
                            g: T.let[T.int32] = b * per_block + u
                            codes: T.let[code_type(qtype)] = group(w, qtype, n, g).codes
                            dots: T.let[T.int32x8] = dot(
                                codes,
                                xq.vload([0, g * LANES], "int8x32"),
                                xm.vload([0, g * MULT_LANES], "int16x16"),
                                signed,
                            )
                            acc[T.Ramp(u % 2 * 8, 1, 8)] = acc[T.Ramp(u % 2 * 8, 1, 8)] + T.Cast(
                                "float32x8", dots
                            ) * group_scales(ss, u)
                    out[0, 0, n] = xr[0] * (sum_lanes(acc, 0) + sum_lanes(acc, 1)) + reduce_lanes(
                        off[T.Ramp(0, 1, width)], width, add
                    )

    return gemv


def _offset(xs, g, o_lo, o_hi, halves: int):
    """The group's offsets times the activation sums of its halves (one sequence)."""
    if halves == 1:
        return o_lo * xs[g, 0]
    return o_lo * xs[g * 2, 0] + o_hi * xs[g * 2 + 1, 0]
