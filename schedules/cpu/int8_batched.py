"""Batched decode kernels for quantized weights: int8 activations, a tile of sequences.

`batch_decode` multiplies one token per sequence by every weight matrix: `[batch, 1, K]`.
The row kernel of `int8_gemv`, run over 4 sequences at a time, cost about 8 vector
instructions per 32-weight group and sequence; this one gets that to 4, what its integer
dot product needs (`pmaddubsw`, `pmaddwd` with the activations' group multiplier, a
convert, an FMA with the weight scale; see `int8_ops`). SmolLM2's gate/up projection
(q4_1, 3072 x 576) for 16 sequences went from 0.71 to 0.48 ms with the tile (the float tiled
schedule: 0.83 ms), to 0.41 ms with the multipliers, and 5-10% lower again with its scratch
buffers on the stack; `benchmarks/decode_matmul.py` prints the comparison. The 4-bit and
K-quant formats now take `int8_columns`' tiles instead, at every batch size, which spend
about half the instructions per weight; these row tiles serve q8_0, q5_0 and q5_1.

Batch invariance (`--deterministic`, docs/cpu-kernels.md#deterministic-mode): a format takes
one tile family at every batch size, and both families compute a row the same way wherever it
sits in the batch (the row tiles: 8 lane partial sums per row, groups in order; the 4-, 2-
and 1-row tail tiles do what an 8-row tile does; the column tiles: one sum per row and
column, groups in order), so a row's result does not depend on the batch. Until 2026-12 the
column tiles took over only from 8 (q5k, q6k: 12) sequences, and a row's bits changed at
that size.

* `TILE_ROWS` sequences share each decoded group of weight codes and its scale vector (one
  load and unpack);
* the formats' offsets (mins, q4_0's -8) multiply the activations' group sums, which are
  stored sequence-minor, so one FMA covers the whole tile (not a gather per sequence);
* the rows are quantized in parallel (serially, 16 rows of K = 1536 took 33 us of a
  0.2 ms kernel).

The activations are quantized as `int8_ops` documents, into buffers padded to whole
tiles with zero rows, so the tile needs no bounds check; only the stores are guarded.
Tests compare it with numpy on gguf's dequantizers, as the single-row kernel.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from . import int8_columns as columns
from . import int8_vnni as vnni_columns
from .int8_codes import LANES, codes_of, group
from .int8_ops import (
    MULT_LANES,
    N_CHUNK,
    code_type,
    dot,
    lane_scales,
    offset_halves,
    quantize_macro,
    sum_lanes,
)

TILE_ROWS = 8  # sequences per tile: 8 accumulators, the codes, the scales: 16 ymm registers
# The batch's remainder (0-7 sequences): 4-row tiles, the last one padded when 3 rows are
# left (a tile decodes the weights' codes once for its rows: two tiles for 3 rows cost more),
# then a 2-row and a 1-row tile for the rest. Before, 4-row tiles only, so a lone sequence
# paid for 4: one thread, CPU time, weights from memory, SmolLM2's q8_0 head (49152 x 576) at
# 1 / 2 / 5 / 6 sequences 2.93 / 2.96 / 5.81 / 5.90 ms -> 1.93 / 2.25 / 4.40 / 4.87 ms
# (`decode`'s one-row kernel 1.91-1.96), q5_0 4096 x 640 0.32 / 0.33 / 0.65 / 0.65 -> 0.23 /
# 0.27 / 0.56 / 0.60 ms (one row: 0.18); at 3, 4, 7 and 8 unchanged.
TAIL_ROWS = 4
# output columns per column tile (Python constants: a name bound inside a macro became a
# 4-byte buffer from TVM's workspace allocator)
COLUMN_COLS, VNNI_COLS = columns.COLS, vnni_columns.COLS


def batched_kernel(
    qtype: str,
    n_out: int,
    k: int,
    batch: int | None,
    column_tiles: bool = True,
    vnni: bool = False,
):
    """`out[b, 0, :] = x[b, 0, :] @ dequantize(w)^T` for a batch of sequences.

    `batch` is static or None (symbolic, `batch_decode`). Parameters (x, w, out) as the
    `quant_matmul` PrimFunc it replaces, or (x, w, table, out) for a lattice format (its
    grid, which every tile family here takes). Where `vnni` (the target has AVX-512 VNNI), every
    batch takes the column tiles of `int8_vnni` (from one sequence on they beat these row
    tiles). Otherwise the formats with `Int8Codes.column_tiles` take `int8_columns`' tiles
    at every batch size, and the others whole tiles of `TILE_ROWS` sequences first, then the
    rest in tiles of `TAIL_ROWS`, 2 and 1 (a batch of 1 pays for 1 row, not 4): every tile
    computes a row alike, so a row's result does not depend on the batch.
    `column_tiles=False` keeps the row tiles (tests, benchmarks). Reached through
    `int8_gemv.gemv_kernel`, which checks the shape.
    """
    groups = k // LANES
    rb = get_format(qtype).row_bytes(k)
    halves = offset_halves(qtype)
    B = tirx.Var("batch_size", "int64") if batch is None else tirx.const(batch, "int64")
    full = B // TILE_ROWS
    padded = (B + TAIL_ROWS - 1) // TAIL_ROWS * TAIL_ROWS  # whole 4-row tiles
    quantize = quantize_macro(groups, halves)
    tile = _tile_macro(qtype, groups, TILE_ROWS)
    # the remainder's tiles: 4 rows each (the last one padded if 3 are left), then 2, then 1
    first4 = full * TILE_ROWS
    count4 = (B - first4 + 1) // TAIL_ROWS
    first2 = first4 + count4 * TAIL_ROWS
    left = tirx.max(B - first2, tirx.const(0, "int64"))
    count2 = left // 2
    tail4 = _tail_macro(qtype, groups, TAIL_ROWS, count4, first4, n_out, rb, B)
    tail2 = _tail_macro(qtype, groups, 2, count2, first2, n_out, rb, B)
    tail1 = _tail_macro(qtype, groups, 1, left % 2, first2 + count2 * 2, n_out, rb, B)
    vnni = vnni and column_tiles
    use_columns = column_tiles and not vnni and codes_of(qtype).column_tiles
    column_tile = columns.tile_macro(qtype, groups) if use_columns else None
    vnni_tile = vnni_columns.tile_macro(qtype, groups) if vnni else None
    # each group's multiplier times the row's step, as floats: only the VNNI tiles read them
    steps_shape = (padded, groups) if vnni else (1, 1)

    @T.macro
    def row_tiles(w, xq, xm, xr, xs, out, table):
        for nc in T.parallel(n_out // N_CHUNK):
            for rt in range(full):
                for ni in range(N_CHUNK):
                    with T.sblock("dot"):
                        T.reads(w[nc * N_CHUNK + ni, 0:rb], xq[:, :], xm[:, :], xr[:], xs[:, :])
                        T.writes(out[:, 0, nc * N_CHUNK + ni])
                        tile(w, nc * N_CHUNK + ni, rt * TILE_ROWS, xq, xm, xr, xs, out, B, table)
            tail4(nc, w, xq, xm, xr, xs, out, table)
            tail2(nc, w, xq, xm, xr, xs, out, table)
            tail1(nc, w, xq, xm, xr, xs, out, table)

    @T.macro
    def column_tiles(w, xq, xm, xr, xs, out, table):
        for nb in T.parallel(n_out // COLUMN_COLS):
            for rt in range((B + columns.ROWS - 1) // columns.ROWS):
                with T.sblock("dot_columns"):
                    T.reads(
                        w[nb * COLUMN_COLS : nb * COLUMN_COLS + COLUMN_COLS, 0:rb],
                        xq[:, :],
                        xm[:, :],
                        xr[:],
                        xs[:, :],
                    )
                    T.writes(out[:, 0, nb * COLUMN_COLS : nb * COLUMN_COLS + COLUMN_COLS])
                    r0: T.let[T.int64] = rt * columns.ROWS
                    column_tile(
                        w,
                        nb * COLUMN_COLS,
                        r0,
                        T.min(B - r0, columns.ROWS),
                        xq,
                        xm,
                        xr,
                        xs,
                        out,
                        table,
                    )

    @T.macro
    def vnni_tiles(w, xq, steps, xs, out, table):
        for nb in T.parallel(n_out // VNNI_COLS):
            for rt in range((B + vnni_columns.ROWS - 1) // vnni_columns.ROWS):
                with T.sblock("dot_vnni"):
                    T.reads(
                        w[nb * VNNI_COLS : nb * VNNI_COLS + VNNI_COLS, 0:rb],
                        xq[:, :, :],
                        steps[:, :],
                        xs[:, :],
                    )
                    T.writes(out[:, 0, nb * VNNI_COLS : nb * VNNI_COLS + VNNI_COLS])
                    r0: T.let[T.int64] = rt * vnni_columns.ROWS
                    rows: T.let[T.int64] = T.min(B - r0, vnni_columns.ROWS)
                    # a compact array for the sums: `out`'s rows are a power of two apart
                    # for most widths (L1 set conflicts; 1 KiB: from TVM's workspace pool)
                    acc = T.sblock_alloc_buffer((vnni_columns.ROWS, 1, VNNI_COLS), "float32")
                    if table is None:
                        vnni_tile(w, nb * VNNI_COLS, r0, rows, xq, steps, xs, acc, 0, 0)
                    else:  # (only the generic tiles take a table)
                        vnni_tile(w, nb * VNNI_COLS, r0, rows, xq, steps, xs, acc, 0, 0, table)
                    for r in range(rows):
                        out[r0 + r, 0, T.Ramp(nb * VNNI_COLS, 1, VNNI_COLS)] = acc[
                            r, 0, T.Ramp(0, 1, VNNI_COLS)
                        ]

    @T.macro
    def body(x, w, out, table):
        xq = T.sblock_alloc_buffer((padded, k), "int8")
        xm = T.sblock_alloc_buffer((padded, groups * MULT_LANES), "int16")
        xr = T.sblock_alloc_buffer((padded,), "float32")
        xs = T.sblock_alloc_buffer((groups * halves, padded), "float32")
        steps = T.sblock_alloc_buffer(steps_shape, "float32")
        for r in T.parallel(B):
            with T.sblock("quantize"):
                T.reads(x[r, 0, 0:k])
                T.writes(
                    xq[r, 0:k], xm[r, 0 : groups * MULT_LANES], xr[r], xs[:, r], steps[r * vnni, :]
                )
                quantize(x, r, xq, xm, xr, xs)
                if vnni:
                    for g in range(groups):
                        steps[r, g] = xr[r] * T.Cast("float32", xm[r, g * MULT_LANES])
        for r, g in T.grid(padded - B, groups):
            with T.sblock("pad"):
                T.reads()
                T.writes(
                    xq[B + r, g * LANES : g * LANES + LANES],
                    xm[B + r, g * MULT_LANES : g * MULT_LANES + MULT_LANES],
                    xr[B + r],
                    xs[g * halves : g * halves + halves, B + r],
                )
                xq[B + r, T.Ramp(g * LANES, 1, LANES)] = T.Broadcast(T.int8(0), LANES)
                xm[B + r, T.Ramp(g * MULT_LANES, 1, MULT_LANES)] = T.Broadcast(
                    T.int16(0), MULT_LANES
                )
                xr[B + r] = T.float32(0)
                for h in T.unroll(halves):
                    xs[g * halves + h, B + r] = T.float32(0)
        if vnni:
            xq_groups = T.decl_buffer((padded, groups, LANES), "int8", data=xq.data)
            vnni_tiles(w, xq_groups, steps, xs, out, table)
        elif use_columns:
            column_tiles(w, xq, xm, xr, xs, out, table)
        else:
            row_tiles(w, xq, xm, xr, xs, out, table)

    if get_format(qtype).table is not None:
        return _with_table(qtype, n_out, k, rb, B, body)

    @T.prim_func(s_tir=True, private=True)
    def gemm(x_handle: T.handle, w: T.Buffer((n_out, rb), "uint8"), out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(x_handle, (B, T.int64(1), k), "float32")
        out = T.match_buffer(out_handle, (B, T.int64(1), n_out), "float32")
        body(x, w, out, None)

    return gemm


def _with_table(qtype: str, n_out: int, k: int, rb: int, B, body):
    """The batched kernel of a format with a constant table (the lattice i-quants): the
    parameters of the fused `quant_matmul` it replaces, (x, w, table, out)."""
    size = len(get_format(qtype).table())

    @T.prim_func(s_tir=True, private=True)
    def gemm(
        x_handle: T.handle,
        w: T.Buffer((n_out, rb), "uint8"),
        table: T.Buffer((size,), "uint8"),
        out_handle: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(x_handle, (B, T.int64(1), k), "float32")
        out = T.match_buffer(out_handle, (B, T.int64(1), n_out), "float32")
        body(x, w, out, table)

    return gemm


def _tail_macro(qtype: str, groups: int, rows: int, count, first, n_out: int, rb: int, B):
    """A macro: `count` tiles of `rows` sequences from row `first`, for the `N_CHUNK` columns
    of chunk `nc`."""
    tile = _tile_macro(qtype, groups, rows)

    @T.macro
    def tail(nc, w, xq, xm, xr, xs, out, table):
        for rt in range(count):
            for ni in range(N_CHUNK):
                with T.sblock("dot_tail"):
                    T.reads(w[nc * N_CHUNK + ni, 0:rb], xq[:, :], xm[:, :], xr[:], xs[:, :])
                    T.writes(out[:, 0, nc * N_CHUNK + ni])
                    tile(w, nc * N_CHUNK + ni, first + rt * rows, xq, xm, xr, xs, out, B, table)

    return tail


def _tile_macro(qtype: str, groups: int, rows: int):
    """A macro: output column `n` for the `rows` sequences from `r0` (whole K)."""
    signed = codes_of(qtype).signed
    halves = offset_halves(qtype)

    @T.macro
    def tile(w, n, r0, xq, xm, xr, xs, out, B, table):
        # stack arrays LLVM keeps in registers (not "local": a workspace allocation per
        # column chunk; see int8_ops.quantize_macro)
        acc = T.sblock_alloc_buffer((rows * 8,), "float32")
        off = T.sblock_alloc_buffer((rows,), "float32")
        for i in T.unroll(rows):
            acc[T.Ramp(i * 8, 1, 8)] = T.Broadcast(T.float32(0), 8)
        off[_lanes(0, rows)] = _splat(T.float32(0), rows)
        for g in range(groups):
            codes: T.let[code_type(qtype)] = group(w, qtype, n, g, table).codes
            s_lo: T.let[T.float32] = group(w, qtype, n, g, table).scale_lo
            s_hi: T.let[T.float32] = group(w, qtype, n, g, table).scale_hi
            o_lo: T.let[T.float32] = group(w, qtype, n, g, table).offset_lo
            o_hi: T.let[T.float32] = group(w, qtype, n, g, table).offset_hi
            ws: T.let[T.float32x8] = lane_scales(s_lo, s_hi)
            for i in T.unroll(rows):
                sums: T.let[T.int32x8] = dot(
                    codes,
                    xq.vload([r0 + i, g * LANES], "int8x32"),
                    xm.vload([r0 + i, g * MULT_LANES], "int16x16"),
                    signed,
                )
                acc[T.Ramp(i * 8, 1, 8)] = acc[T.Ramp(i * 8, 1, 8)] + T.Cast("float32x8", sums) * ws
            off[_lanes(0, rows)] = off[_lanes(0, rows)] + _offsets(
                xs, g, r0, o_lo, o_hi, halves, rows
            )
        for i in T.unroll(rows):
            if r0 + i < B:
                out[r0 + i, 0, n] = xr[r0 + i] * sum_lanes(acc, i) + off[i]

    return tile


def _offsets(xs, g, r0, o_lo, o_hi, halves: int, rows: int):
    """The group's offset times the activation sums, for the tile's `rows` sequences."""
    lo = _splat(o_lo, rows) * xs[g * halves, _lanes(r0, rows)]
    if halves == 1:
        return lo
    return lo + _splat(o_hi, rows) * xs[g * halves + 1, _lanes(r0, rows)]


def _lanes(start, rows: int):
    """An index of `rows` consecutive elements from `start` (a scalar one for one row)."""
    return start if rows == 1 else tirx.Ramp(start, 1, rows)


def _splat(value, rows: int):
    return value if rows == 1 else tirx.Broadcast(value, rows)
