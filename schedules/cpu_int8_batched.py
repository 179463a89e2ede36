"""Batched decode kernels for quantized weights: int8 activations, a tile of sequences.

`batch_decode` multiplies one token per sequence by every weight matrix: `[batch, 1, K]`.
The row kernel of `cpu_int8_gemv`, run over 4 sequences at a time, cost about 8 vector
instructions per 32-weight group and sequence; this one gets that to about 5, which is what
its integer dot product needs (`pmaddubsw`, `pmaddwd`, a convert, a multiply by the two
scales, an FMA). SmolLM2's gate/up projection (q4_1, 3072 x 576) for 16 sequences went from
0.71 to 0.48 ms (the float tiled schedule: 0.83 ms); `benchmarks/decode_matmul.py` prints
the comparison.

* `TILE_ROWS` sequences share each decoded group of weight codes (one load and unpack);
* each group's activation scale is stored broadcast to 8 lanes, so its product with the
  weight scale is one vector multiply with a memory operand (LLVM turns a scalar scale into
  a scalar multiply and a register broadcast: two instructions per sequence);
* the formats' offsets (mins, q4_0's -8) multiply the activations' group sums, which are
  stored sequence-minor, so one FMA covers the whole tile (not a gather per sequence).

The activations are quantized as `cpu_int8_gemv` documents (Q8_0's rule, per 32), into
buffers padded to whole tiles with zero rows, so the tile needs no bounds check; only the
stores are guarded. Tests compare it with numpy on gguf's dequantizers, as the single-row
kernel.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.model_defs.quant_ops import row_bytes

from .cpu_int8_codes import LANES, SIGNED, group
from .cpu_int8_ops import (
    N_CHUNK,
    SCALE_LANES,
    code_type,
    dot,
    lane_scales,
    offset_halves,
    quantize_macro,
    sum_lanes,
)

TILE_ROWS = 8  # sequences per tile: 8 accumulators, the codes, the scales: 16 ymm registers
TAIL_ROWS = 4  # the batch's remainder, in tiles of this many


def batched_kernel(qtype: str, n_out: int, k: int, batch: int | None):
    """`out[b, 0, :] = x[b, 0, :] @ dequantize(w)^T` for a batch of sequences.

    `batch` is static or None (symbolic, `batch_decode`). Parameters (x, w, out) as the
    `quant_matmul` PrimFunc it replaces. Whole tiles of `TILE_ROWS` sequences first, then
    the rest in tiles of `TAIL_ROWS` (a batch of 4 pays for 4 rows, not 8). Reached through
    `cpu_int8_gemv.gemv_kernel`, which checks the shape.
    """
    groups = k // LANES
    rb = row_bytes(qtype, k)
    halves = offset_halves(qtype)
    B = tirx.Var("batch_size", "int64") if batch is None else tirx.const(batch, "int64")
    full = B // TILE_ROWS
    tail = (B - full * TILE_ROWS + TAIL_ROWS - 1) // TAIL_ROWS
    padded = full * TILE_ROWS + tail * TAIL_ROWS
    quantize = quantize_macro(halves)
    tile = _tile_macro(qtype, groups, TILE_ROWS)
    tail_tile = _tile_macro(qtype, groups, TAIL_ROWS)

    @T.prim_func(s_tir=True, private=True)
    def gemm(x_handle: T.handle, w: T.Buffer((n_out, rb), "uint8"), out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(x_handle, (B, T.int64(1), k), "float32")
        out = T.match_buffer(out_handle, (B, T.int64(1), n_out), "float32")
        xq = T.sblock_alloc_buffer((padded, k), "int8")
        xd = T.sblock_alloc_buffer((padded, groups * SCALE_LANES), "float32")
        xs = T.sblock_alloc_buffer((groups * halves, padded), "float32")
        for r, g in T.grid(B, groups):
            with T.sblock("quantize"):
                T.reads(x[r, 0, g * LANES : g * LANES + LANES])
                T.writes(
                    xq[r, g * LANES : g * LANES + LANES],
                    xd[r, g * SCALE_LANES : g * SCALE_LANES + SCALE_LANES],
                    xs[g * halves : g * halves + halves, r],
                )
                quantize(x, r, g, xq, xd, xs)
        for r, g in T.grid(padded - B, groups):
            with T.sblock("pad"):
                T.reads()
                T.writes(
                    xq[B + r, g * LANES : g * LANES + LANES],
                    xd[B + r, g * SCALE_LANES : g * SCALE_LANES + SCALE_LANES],
                    xs[g * halves : g * halves + halves, B + r],
                )
                xq[B + r, T.Ramp(g * LANES, 1, LANES)] = T.Broadcast(T.int8(0), LANES)
                xd[B + r, T.Ramp(g * SCALE_LANES, 1, SCALE_LANES)] = T.Broadcast(
                    T.float32(0), SCALE_LANES
                )
                for h in T.unroll(halves):
                    xs[g * halves + h, B + r] = T.float32(0)
        for nc in T.parallel(n_out // N_CHUNK):
            for rt in range(full):
                for ni in range(N_CHUNK):
                    with T.sblock("dot"):
                        T.reads(w[nc * N_CHUNK + ni, 0:rb], xq[:, :], xd[:, :], xs[:, :])
                        T.writes(out[:, 0, nc * N_CHUNK + ni])
                        tile(w, nc * N_CHUNK + ni, rt * TILE_ROWS, xq, xd, xs, out, B)
            for rt in range(tail):
                for ni in range(N_CHUNK):
                    with T.sblock("dot_tail"):
                        T.reads(w[nc * N_CHUNK + ni, 0:rb], xq[:, :], xd[:, :], xs[:, :])
                        T.writes(out[:, 0, nc * N_CHUNK + ni])
                        r0: T.let[T.int64] = full * TILE_ROWS + rt * TAIL_ROWS
                        tail_tile(w, nc * N_CHUNK + ni, r0, xq, xd, xs, out, B)

    return gemm


def _tile_macro(qtype: str, groups: int, rows: int):
    """A macro: output column `n` for the `rows` sequences from `r0` (whole K)."""
    signed = qtype in SIGNED
    halves = offset_halves(qtype)

    @T.macro
    def tile(w, n, r0, xq, xd, xs, out, B):
        acc = T.sblock_alloc_buffer((rows * 8,), "float32", scope="local")
        off = T.sblock_alloc_buffer((rows,), "float32", scope="local")
        for i in T.unroll(rows):
            acc[T.Ramp(i * 8, 1, 8)] = T.Broadcast(T.float32(0), 8)
        off[T.Ramp(0, 1, rows)] = T.Broadcast(T.float32(0), rows)
        for g in range(groups):
            codes: T.let[code_type(qtype)] = group(w, qtype, n, g).codes
            s_lo: T.let[T.float32] = group(w, qtype, n, g).scale_lo
            s_hi: T.let[T.float32] = group(w, qtype, n, g).scale_hi
            o_lo: T.let[T.float32] = group(w, qtype, n, g).offset_lo
            o_hi: T.let[T.float32] = group(w, qtype, n, g).offset_hi
            ws: T.let[T.float32x8] = lane_scales(s_lo, s_hi)
            for i in T.unroll(rows):
                sums: T.let[T.int32x8] = dot(
                    codes, xq.vload([r0 + i, g * LANES], "int8x32"), signed
                )
                acc[T.Ramp(i * 8, 1, 8)] = acc[T.Ramp(i * 8, 1, 8)] + T.Cast("float32x8", sums) * (
                    ws * xd.vload([r0 + i, g * SCALE_LANES], "float32x8")
                )
            off[T.Ramp(0, 1, rows)] = off[T.Ramp(0, 1, rows)] + _offsets(
                xs, g, r0, o_lo, o_hi, halves, rows
            )
        for i in T.unroll(rows):
            if r0 + i < B:
                out[r0 + i, 0, n] = sum_lanes(acc, i) + off[i]

    return tile


def _offsets(xs, g, r0, o_lo, o_hi, halves: int, rows: int):
    """The group's offset times the activation sums, for the tile's `rows` sequences."""
    lo = T.Broadcast(o_lo, rows) * xs.vload([g * halves, r0], f"float32x{rows}")
    if halves == 1:
        return lo
    return lo + T.Broadcast(o_hi, rows) * xs.vload([g * halves + 1, r0], f"float32x{rows}")
