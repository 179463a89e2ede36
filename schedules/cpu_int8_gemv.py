"""Decode matrix-vector kernels for quantized weights: int8 activations, integer dot products.

What llama.cpp does on x86, as TensorIR: the activation row is quantized to int8 in groups
of 32 (Q8_0's rule: `d = max|x| / 127`, `q = round(x / d)` half away from zero, `d` kept
as f16), then every 32-weight group of a row costs one `pmaddubsw` (32 unsigned weight codes
times 32 int8 activations, pairwise summed to 16 int16), one `pmaddwd` (to 8 int32), one
convert and one FMA into 8 float partial sums, scaled by the group's `scale * d`. The
formats' offsets (mins, the `-8` of q4_0, ...) multiply the group's activation sum, which
the quantize step computes once. See `cpu_int8_codes` for how each format becomes codes.

Compared with the float schedule of `cpu_quant` (decode each weight to float, then an FMA:
about one instruction per weight), this is about half an instruction per weight; SmolLM2's
q4_1 gate/up projection went from 0.35 to 0.14 ms.

Numerics: the result is the exact dot product of the dequantized weights with the Q8_0
round trip of the activations, up to float32 summation order; tests compare it with
`gguf.quants.dequantize(W) @ dequantize(quantize(x, Q8_0))` in numpy. Only decode uses it
(one token per sequence); prefill keeps float activations (`cpu_tiled`), as its weights are
decoded once per tile of tokens and it is not bound by the per-weight decode cost.

Needs AVX2 (`pmaddubsw`, `pmaddwd`, `psignb` on 256-bit vectors); `supported(target)` says.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.model_defs.quant_ops import BLOCK, row_bytes

from .cpu_int8_codes import LANES, SIGNED, group
from .tir_vectors import add, lanes, reduce_lanes

N_CHUNK = 16  # output columns per parallel task
ROWS = 4  # sequences sharing one decoded group in a batched decode


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


def _vec(dtype: str, count: int) -> str:
    return dtype if count == 1 else f"{dtype}x{count}"


def _magnitude(v, count: int):
    """|v| of float32 lanes, by clearing the sign bits (see `_round_away`)."""
    bits = tirx.reinterpret(_vec("int32", count), v) & tirx.const(0x7FFFFFFF, "int32")
    return tirx.reinterpret(_vec("float32", count), bits)


def _round_away(v, count: int):
    """Round half away from zero, as `gguf`'s (and llama.cpp's reference) Q8_0 quantizer.

    |v| and the sign are taken from the bits: `abs` and a select on a 32-lane vector made
    TVM's TIR passes take 7 s per kernel.
    """
    bits = tirx.reinterpret(_vec("int32", count), v)
    magnitude = _magnitude(v, count)
    whole = tirx.floor(magnitude)
    r = whole + tirx.floor((magnitude - whole) * 2.0)
    sign = bits & tirx.const(-(2**31), "int32")
    return tirx.reinterpret(
        _vec("float32", count), tirx.reinterpret(_vec("int32", count), r) | sign
    )


def _dot(codes, xq, signed: bool):
    """8 int32 sums, each of 4 consecutive code * activation products."""
    if signed:  # int8 weights: |w| times x with w's sign (pmaddubsw wants one unsigned side)
        xq = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", xq, codes)
        codes = tirx.Cast("uint8x32", tirx.abs(codes))
    pairs = T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", codes, xq)
    ones = tirx.Broadcast(tirx.const(1, "int16"), 16)
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, ones)


def _row_total(acc, off, row: int, chains: int):
    """Sum of a row's accumulator chains: their lanes, then their offset sums."""
    total = reduce_lanes(acc[tirx.Ramp(row * chains * 8, 1, 8)], 8, add)
    for c in range(1, chains):
        total = total + reduce_lanes(acc[tirx.Ramp((row * chains + c) * 8, 1, 8)], 8, add)
    for c in range(chains):
        total = total + off[row * chains + c]
    return total


def _code_type(qtype: str):
    return T.int8x32 if qtype in SIGNED else T.uint8x32


def _lane_scales(lo, hi):
    """8 lanes: the first 4 sums cover weights 0-15 of the group, the last 4 weights 16-31."""
    return tirx.Shuffle(
        [tirx.Broadcast(lo, 4), tirx.Broadcast(hi, 4)], [tirx.const(i, "int32") for i in range(8)]
    )


def gemv_kernel(qtype: str, n_out: int, k: int, batch: int | None, rows: int = ROWS):
    """`out[b, 0, :] = x[b, 0, :] @ dequantize(w)^T` for `qtype` weights [n_out, k].

    `batch` is the static number of sequences, or None for a symbolic one (`batch_decode`).
    Same parameters as the `quant_matmul` PrimFunc it replaces: (x, w, out).
    """
    if k % LANES or n_out % N_CHUNK:
        raise ValueError(f"int8 gemv needs k % {LANES} == 0 and n % {N_CHUNK} == 0")
    groups = k // LANES
    rb = row_bytes(qtype, k)
    rows = 1 if batch == 1 else rows
    signed = qtype in SIGNED
    # independent accumulators per row: with one row, two chains (even and odd groups) hide
    # the FMA latency that otherwise bounds the loop
    chains = 2 if rows == 1 and groups % 2 == 0 else 1
    slots = rows * chains
    # K-quants: a whole super-block per iteration, so its scale bytes are loaded once
    unroll = BLOCK[qtype][0] // LANES if rows == 1 else 1
    unroll = max(unroll, chains)
    B = tirx.Var("batch_size", "int64") if batch is None else tirx.const(batch, "int64")

    @T.prim_func(s_tir=True, private=True)
    def gemv(x_handle: T.handle, w: T.Buffer((n_out, rb), "uint8"), out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(x_handle, (B, T.int64(1), k), "float32")
        out = T.match_buffer(out_handle, (B, T.int64(1), n_out), "float32")
        xq = T.sblock_alloc_buffer((B, k), "int8")
        xd = T.sblock_alloc_buffer((B, groups), "float32")  # each group's scale (f16-rounded d)
        xs = T.sblock_alloc_buffer((B, groups * 2), "float32")  # d * sum(q) per 16 activations
        for r, g in T.grid(B, groups):
            with T.sblock("quantize"):
                T.reads(x[r, 0, g * LANES : g * LANES + LANES])
                T.writes(xq[r, g * LANES : g * LANES + LANES], xd[r, g], xs[r, g * 2 : g * 2 + 2])
                v: T.let[T.float32x32] = x.vload([r, T.int64(0), g * LANES], "float32x32")
                d: T.let[T.float32] = reduce_lanes(_magnitude(v, 32), 32, T.max) / T.float32(127)
                inv: T.let[T.float32] = T.Select(d == T.float32(0), T.float32(0), T.float32(1) / d)
                qs = T.sblock_alloc_buffer((LANES,), "int32", scope="local")
                scale = T.sblock_alloc_buffer((1,), "float32", scope="local")
                scale[0] = inv  # a buffer, not a let: keeps the shuffles out of the loop below
                for j in T.vectorized(LANES):  # scalar form: TVM's passes are slow on 32-lane
                    qs[j] = T.Cast("int32", _round_away(x[r, 0, g * LANES + j] * scale[0], 1))
                q: T.let[T.int32x32] = qs.vload([0], "int32x32")
                xq[r, T.Ramp(g * LANES, 1, LANES)] = T.Cast("int8x32", q)
                dh: T.let[T.float32] = T.Cast("float32", T.Cast("float16", d))
                xd[r, g] = dh
                xs[r, g * 2] = dh * T.Cast("float32", reduce_lanes(lanes(q, range(16)), 16, add))
                xs[r, g * 2 + 1] = dh * T.Cast(
                    "float32", reduce_lanes(lanes(q, range(16, 32)), 16, add)
                )
        for nc in T.parallel(n_out // N_CHUNK):
            for rt in range((B + rows - 1) // rows):
                for ni in range(N_CHUNK):
                    with T.sblock("dot"):
                        T.reads(w[nc * N_CHUNK + ni, 0:rb], xq[:, :], xd[:, :], xs[:, :])
                        T.writes(out[rt * rows : rt * rows + rows, 0, nc * N_CHUNK + ni])
                        n: T.let[T.int32] = nc * N_CHUNK + ni
                        acc = T.sblock_alloc_buffer((slots * 8,), "float32", scope="local")
                        off = T.sblock_alloc_buffer((slots,), "float32", scope="local")
                        for a in T.unroll(slots):
                            acc[T.Ramp(a * 8, 1, 8)] = T.Broadcast(T.float32(0), 8)
                            off[a] = T.float32(0)
                        for gu in range(groups // unroll):
                            for u in T.unroll(unroll):
                                g: T.let[T.int32] = gu * unroll + u
                                # (TVMScript binds expressions only: one field per call)
                                codes: T.let[_code_type(qtype)] = group(w, qtype, n, g).codes
                                s_lo: T.let[T.float32] = group(w, qtype, n, g).scale_lo
                                s_hi: T.let[T.float32] = group(w, qtype, n, g).scale_hi
                                o_lo: T.let[T.float32] = group(w, qtype, n, g).offset_lo
                                o_hi: T.let[T.float32] = group(w, qtype, n, g).offset_hi
                                for i in T.unroll(rows):
                                    row: T.let[T.int64] = T.min(rt * rows + i, B - 1)
                                    a: T.let[T.int32] = i * chains + u % chains
                                    sums: T.let[T.int32x8] = _dot(
                                        codes, xq.vload([row, g * LANES], "int8x32"), signed
                                    )
                                    acc[T.Ramp(a * 8, 1, 8)] = acc[T.Ramp(a * 8, 1, 8)] + T.Cast(
                                        "float32x8", sums
                                    ) * (_lane_scales(s_lo, s_hi) * T.Broadcast(xd[row, g], 8))
                                    # one add on the loop-carried chain, the products off it
                                    off[a] = off[a] + (
                                        o_lo * xs[row, g * 2] + o_hi * xs[row, g * 2 + 1]
                                    )
                        for i in T.unroll(rows):
                            if rt * rows + i < B:
                                out[rt * rows + i, 0, n] = _row_total(acc, off, i, chains)

    return gemv
