"""`decode`'s AVX2 one-row kernel for the K-quants with integer sub-scales (q4k, q5k).

`int8_gemv`'s block kernel spends, per 32-weight group, two integer multiplies
(`pmaddubsw`, `pmaddwd` with the activations' multiplier `m`), a convert and an FMA with the
group's float scale: on AVX2 those four share two ports, and the kernel is bound by them (a
thread reads 13-14 GB/s of q4k weights from cache where the AVX-512 VNNI kernel reads 24-25).

A q4k or q5k group's scale is `d * sc`, a 6-bit integer `sc` under the super-block's f16 `d`,
and `m` is an integer too: so `pmaddwd` multiplies the group's pairs by `m * sc` (one int16,
computed for the block's 8 groups with one `pmullw`), the 8 groups add up in int32, and only
the block pays a convert and an FMA with `d`. What llama.cpp does with its per-256 activation
scale (`q8_K`), with the activations still quantized per 32 as `int8_ops` documents, under a
smaller largest multiplier (`multiplier_limit`: `m * sc` must fit int16, and the block's sums
int32).

The activations' step is kept per super-block (`quantize_macro(unit_groups=8)`), not per
row: with `m <= 520` (q4k) or 270 (q5k) a group under 1/520 of its own block's largest
rounds to zero, as in q8_K's per-256 step (largest / 127) where every group does; a per-row
step at that limit measured 8e-3 relative error on a random row against 3e-7 per block. On a
real model's decode (Gemma 3 270M Q4_K_M, 300 tokens, `benchmarks/decode_kl.py`) the KL to the
f32 weights' logits is 0.00237 mean against 0.00239 with the block kernel's per-row step.

Numerics: the exact dot product of the dequantized weights with the activations rounded
under that limit, up to float32 summation order (tests: numpy on `gguf`'s dequantizers, and
blocks of all-largest codes and scales at the limit, where a larger `m` overflows).

Measured on an Intel Xeon (2 cores of a VM, AVX-512 VNNI, running this AVX2 code;
2026-12-07): one thread, in cache, block kernel -> this one: q4k 1.14-1.35x, q5k
1.06-1.11x; two threads, weights from memory, GB/s: q4k 16384 x 3072 21.5 -> 23.5, q4k
3072 x 8192 19.4 -> 20.8 (the VNNI kernel: 22.6, 20.0); a Llama-3.2-3B Q4_K_M artifact built
`--cpu x86-64-v3`, with `int8_ops.AHEAD` 4 KiB, steps in 85-89 ms against 97-102 before.
On a later session's Xeon VM, whose memory served the 3B step in 72 ms, that step measured
the same with and without both changes (71.3-73.0 against 72.8-73.3 ms, interleaved): the
kernel helps where decode is bound by instructions, not where memory bounds it. Not
measured on an AVX2-only CPU.

Not for q6k: its int8 sub-scales (|sc| <= 128, one per 16 weights) would allow m <= 65, and
the kernel built that way (each group's two `m * sc` halves picked by a `vpermd`) ran at the
block kernel's speed, in cache and from memory (2048 x 4096, one thread: 283.7 against 283.6
us; its block loop 117 instructions against 119): q6k's code unpacking (16 `vpand`, 8 `vpor`,
10 shifts per block), not its scales, bounds it.
"""

from __future__ import annotations

from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from ..tir_common import STREAM, add, prefetch, reduce_lanes
from .int8_codes import LANES, Row, codes_of, group
from .int8_ops import (
    AHEAD,
    M_MAX,
    MULT_LANES,
    N_CHUNK,
    code_type,
    dot,
    quantize_macro,
    row_streams,
    streamed_row,
)

INT32_MAX = 2**31 - 1
INT16_MAX = 2**15 - 1
ACT_MAX = 127  # the largest |activation code|


def applies(qtype: str, k: int) -> bool:
    """Whether `qtype`'s one-row AVX2 kernel is this one."""
    fmt = get_format(qtype)
    return (
        fmt.int8 is not None
        and fmt.int8.int_block_scales is not None
        and not fmt.int8.signed
        and k % fmt.block_size == 0
    )


def multiplier_limit(qtype: str) -> int:
    """The largest activation multiplier `m` for `qtype`: `m * sc` fits int16, and a block's
    groups summed in int32 cannot overflow (`pmaddwd` adds two `pmaddubsw` pairs, each at most
    2 * max_code * 127). q4k: 520, q5k: 270."""
    codes = codes_of(qtype)
    per_block = get_format(qtype).block_size // LANES
    combined = min(INT16_MAX, INT32_MAX // (per_block * 4 * codes.max_code * ACT_MAX))
    return min(M_MAX, combined // codes.int_block_scales.largest)


def row_kernel(qtype: str, n_out: int, k: int):
    """`out[0, 0, :] = x[0, 0, :] @ dequantize(w)^T` for one sequence, (x, w, out)."""
    fmt = get_format(qtype)
    codes_info = codes_of(qtype)
    decode = codes_info.int_block_scales.decode
    groups = k // LANES
    per_block = fmt.block_size // LANES
    blocks = groups // per_block
    ts = fmt.type_size
    rb = fmt.row_bytes(k)
    quantize = quantize_macro(groups, 1, m_max=multiplier_limit(qtype), unit_groups=per_block)
    streams = row_streams(n_out)
    lines = -(-ts // 64)  # per super-block (the next block's lines cover a straddled one)
    signed = codes_info.signed

    @T.prim_func(s_tir=True, private=True)
    def gemv(
        x: T.Buffer((1, 1, k), "float32"),
        w: T.Buffer((n_out, rb), "uint8"),
        out: T.Buffer((1, 1, n_out), "float32"),
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        xq = T.sblock_alloc_buffer((1, k), "int8")
        xm = T.sblock_alloc_buffer((1, groups * MULT_LANES), "int16")
        xr = T.sblock_alloc_buffer((blocks,), "float32")  # a step per super-block
        xs = T.sblock_alloc_buffer((groups, 1), "float32")
        sums = T.sblock_alloc_buffer((groups,), "float32")  # xs, for vector loads
        mults = T.sblock_alloc_buffer((groups,), "int16")  # one `m` per group
        with T.sblock("quantize"):
            T.reads(x[0, 0, 0:k])
            T.writes(xq[0, 0:k], xm[0, 0 : groups * MULT_LANES], xr[:], xs[:, 0], sums[:], mults[:])
            quantize(x, 0, xq, xm, xr, xs)
            for i in range(groups):
                sums[i] = xs[i, 0]
                mults[i] = xm[0, i * MULT_LANES]
        for nc in T.parallel(n_out // N_CHUNK // streams):
            for ni, si in T.grid(N_CHUNK, streams):
                with T.sblock("dot"):
                    n = T.meta_var(streamed_row(nc, ni, si, n_out, streams))
                    T.reads(w[n, 0:rb], xq[0, :], xr[:], sums[:], mults[:])
                    T.writes(out[0, 0, n])
                    # stack arrays (see int8_ops.quantize_macro): the float sums, the offsets'
                    # lanes, the block's int32 sums and its groups' `m * sc`
                    acc = T.sblock_alloc_buffer((8,), "float32")
                    off = T.sblock_alloc_buffer((8,), "float32")
                    isum = T.sblock_alloc_buffer((8,), "int32")
                    cs = T.sblock_alloc_buffer((8,), "int32")
                    acc[T.Ramp(0, 1, 8)] = T.Broadcast(T.float32(0), 8)
                    off[T.Ramp(0, 1, 8)] = T.Broadcast(T.float32(0), 8)
                    for b in range(blocks):
                        for j in T.unroll(lines):  # the block's lines, `AHEAD` bytes early
                            T.evaluate(
                                prefetch(T.address_of(w[n, b * ts + j * 64 + AHEAD]), STREAM)
                            )
                        scales = T.meta_var(decode(Row(w, n, b * ts)))
                        # `m * sc` in both halves of an int32, so that a group's 16 int16 lanes
                        # are one 32-bit broadcast (LLVM: a `vpermd`; `vpbroadcastw` of an
                        # int16 took two shuffles)
                        c: T.let[T.int32x8] = T.Cast(
                            "int32x8", mults[T.Ramp(b * 8, 1, 8)] * scales[0]
                        )
                        cs[T.Ramp(0, 1, 8)] = c | (c << T.Broadcast(T.int32(16), 8))
                        off[T.Ramp(0, 1, 8)] = (
                            off[T.Ramp(0, 1, 8)] + scales[2] * sums[T.Ramp(b * 8, 1, 8)]
                        )
                        isum[T.Ramp(0, 1, 8)] = T.Broadcast(T.int32(0), 8)
                        for u in T.unroll(per_block):
                            g: T.let[T.int32] = b * per_block + u
                            codes: T.let[code_type(qtype)] = group(w, qtype, n, g).codes
                            isum[T.Ramp(0, 1, 8)] = isum[T.Ramp(0, 1, 8)] + dot(
                                codes,
                                xq.vload([0, g * LANES], "int8x32"),
                                T.reinterpret("int16x16", T.Broadcast(cs[u], 8)),
                                signed,
                            )
                        acc[T.Ramp(0, 1, 8)] = acc[T.Ramp(0, 1, 8)] + T.Cast(
                            "float32x8", isum[T.Ramp(0, 1, 8)]
                        ) * T.Broadcast(scales[1] * xr[b], 8)
                    out[0, 0, n] = reduce_lanes(acc[T.Ramp(0, 1, 8)], 8, add) + reduce_lanes(
                        off[T.Ramp(0, 1, 8)], 8, add
                    )

    return gemv
