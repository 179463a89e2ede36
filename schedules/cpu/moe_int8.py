"""The grouped expert matmul (`schedules.moe`) with int8 activations, for AVX-512 VNNI CPUs.

`moe.grouped_matmul_kernel` decodes each active expert's quantized weight rows to float and
multiplies float activations: about 8 multiply-adds per instruction, plus the decode of every
weight. The dense layers on these CPUs round the activations to int8 and run integer dot
products (`int8_prefill`, `int8_vnni`: 64 multiply-adds per `vpdpbusd`, the codes never
turned into floats). This kernel gives the experts the same machinery, imported, not copied:

* activations quantized per row as `int8_ops` documents (`quantize_macro`: per 32 with a
  per-row step, llama.cpp's Q8_0 rule), in parallel over rows. Gate and up read the tokens
  through `rows`: each token is quantized once and its codes, steps and sums copied to its
  sorted rows (a token has `top_k` of them); down's input is in sorted order already;
* the output columns on the thread pool in blocks of 16 (every thread walks every active
  expert, as in the float kernel); per expert, its rows in tiles of up to 16, each tile one
  `int8_vnni.tile_macro` call on a view of the stacked weight that starts at the expert's
  first row (`decl_buffer` with an element offset), so the dense tiles index it as their own
  `[n_out, row_bytes]` weight. Experts without rows cost nothing.
* from `WIDE_ROWS` rows on (prefill), a task takes `WIDE_BLOCKS` column blocks of each
  expert in turn, not one: an expert's int8 rows are then read from L1/L2 for 8 blocks, not
  fetched again from L3 for every block (all experts' rows, 4 MiB at Qwen3-30B-A3B's gate
  with 256 tokens, pass through each task). Gate (768 x 2048, 2048 rows, q4_0, one thread,
  CPU time) 68.4 -> 33.0 ms, down (2048 x 768) 42.9 -> 38.7 ms; the dense prefill kernel
  takes 32 ms for the same multiply-adds. Decode keeps one block per task: more tasks for
  the threads, and its rows are few.

Decode (a row or two per expert) takes the same tiles with short row counts: a group's codes
are transposed once per 16 columns whatever the row count, still cheaper than decoding them
to float: 4 tokens at Qwen3-30B-A3B's shapes (30 experts active), one thread, gate q4_0
8.7 -> 3.1 ms, q4k 34.4 -> 3.8 ms (docs/benchmarks.md).

Numerics: each row's outputs are its rounded activations times the dequantized weights, the
same numbers the dense int8 kernels give a row (tests: `tests/test_moe_int8.py`, numpy on
the `gguf` dequantizers with the rounding mirrored). Used when the target has AVX-512 VNNI
(`int8_vnni.supported`) and the format has int8 groups; other CPUs keep float activations,
as dense prefill does.
"""

from __future__ import annotations

from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from . import int8_vnni
from .int8_codes import LANES, has_table
from .int8_ops import MULT_LANES, offset_halves, quantize_macro

COLS = int8_vnni.COLS  # output columns per tile and per parallel task
ROWS = int8_vnni.ROWS  # rows of one expert sharing a transposed group of codes
WIDE_BLOCKS = 8  # column blocks per parallel task in prefill (see the module docstring)
WIDE_ROWS = 512  # rows from which a step counts as prefill here

_ATTRS = {"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8}  # 8: opaque


def supports(qtype: str, n_out: int, k_dim: int, target) -> bool:
    """Whether `grouped_int8_kernel` serves these weights on `target`."""
    return (
        qtype != "none"
        and get_format(qtype).int8 is not None
        and not has_table(qtype)
        and k_dim % LANES == 0
        and n_out % COLS == 0
        and int8_vnni.supported(target)
    )


def grouped_int8_kernel(
    experts: int, n_out: int, k_dim: int, qtype: str, gather: bool, wide_rows: int = WIDE_ROWS
):
    """`moe.grouped_matmul_kernel`'s function (same parameters: x, rows, indptr, active, w,
    y) for float32 activations and `qtype` expert blocks, with int8 activations; from
    `wide_rows` rows on, `WIDE_BLOCKS` column blocks per parallel task."""
    if k_dim % LANES or n_out % COLS:
        raise ValueError(f"int8 grouped matmul needs k % {LANES} == 0 and n % {COLS} == 0")
    groups = k_dim // LANES
    rb = get_format(qtype).row_bytes(k_dim)
    halves = offset_halves(qtype)
    quantize = quantize_macro(groups, halves)
    tile = int8_vnni.tile_macro(qtype, groups)
    blocks = n_out // COLS
    wide = next(b for b in range(min(WIDE_BLOCKS, blocks), 0, -1) if blocks % b == 0)

    @T.macro
    def quantize_row(src, r, xq, xm, xr, xs, steps):
        quantize(src, r, xq, xm, xr, xs)
        for g in range(groups):
            steps[r, g] = xr[r] * T.Cast("float32", xm[r, g * MULT_LANES])

    @T.macro
    def quantize_sorted(x_rows, rows, n, m, xq, xs, steps):
        """Sorted row r's codes, steps and sums: those of token rows[r] (gate, up)."""
        tq = T.sblock_alloc_buffer((m, k_dim), "int8")
        tm = T.sblock_alloc_buffer((m, groups * MULT_LANES), "int16")
        tr = T.sblock_alloc_buffer((m,), "float32")
        ts = T.sblock_alloc_buffer((groups * halves, m), "float32")
        tsteps = T.sblock_alloc_buffer((m, groups), "float32")
        for t in T.parallel(m):
            with T.sblock("quantize"):
                T.reads()
                T.writes()
                quantize_row(x_rows, t, tq, tm, tr, ts, tsteps)
        for r in T.parallel(n):
            with T.sblock("gather"):
                T.reads()
                T.writes()
                src: T.let[T.int64] = T.Cast("int64", rows[r])
                for i in T.vectorized(k_dim):
                    xq[r, i] = tq[src, i]
                for g in range(groups):
                    steps[r, g] = tsteps[src, g]
                for i in range(groups * halves):
                    xs[i, r] = ts[i, src]

    @T.macro
    def quantize_in_order(x_rows, rows, n, m, xq, xs, steps):
        """Down's input: already one row per sorted row."""
        xm = T.sblock_alloc_buffer((n, groups * MULT_LANES), "int16")
        xr = T.sblock_alloc_buffer((n,), "float32")
        for r in T.parallel(n):
            with T.sblock("quantize"):
                T.reads()
                T.writes()
                quantize_row(x_rows, r, xq, xm, xr, xs, steps)

    prepare = quantize_sorted if gather else quantize_in_order

    @T.prim_func(private=True, s_tir=True)
    def grouped_int8(
        var_x: T.handle,
        var_rows: T.handle,
        var_indptr: T.handle,
        var_active: T.handle,
        var_w: T.handle,
        var_y: T.handle,
    ):
        T.func_attr(_ATTRS)
        m = T.int64()
        n = T.int64()
        x = T.match_buffer(var_x, (m, k_dim), "float32")
        rows = T.match_buffer(var_rows, (n,), "int32")
        indptr = T.match_buffer(var_indptr, (experts + 1,), "int32")
        active = T.match_buffer(var_active, (experts + 1,), "int32")
        w = T.match_buffer(var_w, (experts * n_out, rb), "uint8")
        y = T.match_buffer(var_y, (n, n_out), "float32")
        # the dense macros' views: one [1, K] row per token or sorted row
        x_rows = T.decl_buffer((m, T.int64(1), k_dim), "float32", data=x.data)
        y_rows = T.decl_buffer((n, T.int64(1), n_out), "float32", data=y.data)
        xq = T.sblock_alloc_buffer((n, k_dim), "int8")
        xs = T.sblock_alloc_buffer((groups * halves, n), "float32")
        steps = T.sblock_alloc_buffer((n, groups), "float32")
        prepare(x_rows, rows, n, m, xq, xs, steps)
        # the tiles read the codes as [rows, groups, 32]
        xq_groups = T.decl_buffer((n, groups, LANES), "int8", data=xq.data)
        per_task: T.let[T.int64] = T.Select(n >= wide_rows, T.int64(wide), T.int64(1))
        for c in T.parallel(blocks // per_task):
            for j in range(active[0]):
                e: T.let[T.int32] = active[j + 1]
                lo: T.let[T.int64] = T.Cast("int64", indptr[e])
                count: T.let[T.int64] = T.Cast("int64", indptr[e + 1]) - lo
                # expert e's [n_out, row_bytes] weight, as the dense tiles index theirs
                we = T.decl_buffer(
                    (n_out, rb), "uint8", data=w.data, elem_offset=T.Cast("int64", e) * n_out * rb
                )
                for b in range(per_task):
                    for rt in range((count + ROWS - 1) // ROWS):
                        with T.sblock("dot_vnni"):
                            T.reads()
                            T.writes()
                            r0: T.let[T.int64] = lo + rt * ROWS
                            n_rows: T.let[T.int64] = T.min(count - rt * ROWS, ROWS)
                            n0: T.let[T.int64] = (c * per_task + b) * COLS
                            # sums straight into y: acc[r0 + r, 0, n0 : n0 + 16]
                            tile(we, n0, r0, n_rows, xq_groups, steps, xs, y_rows, r0, n0)

    return grouped_int8
