"""Prefill matmuls for quantized weights on CPUs with AVX-512 VNNI: int8 activations.

(AVX2 CPUs take `int8_prefill_columns`, built on batched decode's AVX2 column tiles.)

Prefill (`[1, tokens, K]` times a quantized `[N, K]` weight) used float activations and the
tiled schedule of `cpu.tiled`: a chunk of weight rows decoded to float once, then 8-lane
FMAs, one per 8 multiply-adds. llama.cpp quantizes the activations to 8 bits and runs
integer dot products for every format; on AVX-512 VNNI a `vpdpbusd` does 64 multiply-adds.
This kernel does the same with the batched-decode machinery, whose 16-column tiles
(`int8_vnni`) are a GEMM already: a tile transposes one group of 16 weight rows' codes once
and serves `ROWS` token rows with it.

* every token row is quantized as `int8_ops` documents (in parallel over rows), the same
  numbers `batch_decode` uses for the same row: prefill and decode round alike;
* the output columns run on the thread pool in blocks of 16, tile of `ROWS` token rows after
  tile (the tile loop outside the parallel one, as in `int8_prefill_columns`: a tile's
  codes stay in L2 while the column blocks pass over them, and each block's weights are read
  again per tile instead; Llama 3.2 3B's shapes, 500 tokens, 2 threads: q4k gate/up 68.4 ->
  65.8 ms, down 37.2 -> 34.7, q6k 3072 -> 16384 84.3 -> 76.8, q5k gate/up 77.0 -> 72.0, q6k
  down even; the model's whole prefill 4531 -> 4454 ms);
* tiles of 128 rows, not decode's 16: the weights' transpose (for q6k, decoding a group's
  16 columns cost as much as its 16 rows of `vpdpbusd`) is shared by 8 times the rows
  (64 -> 128 rows, in-process A/B, one thread: q4k 2048 -> 16384 130 -> 122 ms, q6k
  8192 -> 2048 100 -> 87 ms);
* so that a tile's rows do not become 64-128 memory streams 2-8 KiB apart (the prefetchers
  lost track: q4k 8192 -> 2048 got slower with 64 rows), the codes are copied once more
  by tile, group, row (`xt`: a group's 128 rows are 4 KiB in a row, a tile reads one
  stream), and `steps` is kept group-major as `xs` already is; a tile's sums go to a compact
  array (`out`'s rows are a power of two apart: 64 of them shared a few L1 sets).

500 tokens, one thread, CPU time, 16-row tiles -> 64-row ones (load about 10 on the 2 cores, so
noisy): q4k 2048 -> 16384 176 -> 126 ms, q4k 8192 -> 2048 118 -> 81 ms, q6k 8192 -> 2048
255 -> 115 ms. A Llama-3.2-1B-shaped Q4_K_M file's 500-token prefill, one thread, CPU time
in its kernels: 7.9 -> 6.2 s (gate/up 2.91 -> 2.41 s, q6k down 2.21 -> 1.25 s).

The token axis is the second of `[1, tokens, K]`; the decode macros index `[rows, 1, K]`,
which is the same memory, so the kernel declares that view of `x` and `out`.

The lattice i-quants (a grid table, a fourth kernel input) take the generic tiles with the
grid passed along; each of a tile's 16 rows' codes is decoded once into a buffer and the
transposes read it from there (built as expressions, the transposes copied each row's grid
decode many times over and TVM's passes took minutes on one kernel). A Llama-3.2-3B-shaped
IQ3_M file's 500-token prefill went from the float tiles' 22 tok/s to the figure in
docs/benchmarks.md.

Numerics: as `batch_decode`'s (the activations rounded per 32 to int8 with a per-row step),
not float; the manifest says so (`target.details.prefill_activations`). Tests compare it
with numpy on gguf's dequantizers, rounding mirrored (`tests/test_int8_prefill.py`).
"""

from __future__ import annotations

from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from . import int8_vnni
from .int8_codes import LANES
from .int8_ops import MULT_LANES, offset_halves, quantize_macro

COLS = int8_vnni.COLS  # output columns per tile and per parallel task
ROWS = 128  # token rows sharing one transposed group of codes


def prefill_kernel(qtype: str, n_out: int, k: int, rows: int = ROWS):
    """`out[0, t, :] = x[0, t, :] @ dequantize(w)^T` for a symbolic token count.

    Same parameters as the `quant_matmul` PrimFunc it replaces: (x, w, out), or (x, w,
    table, out) for a format with a constant table (the lattice i-quants' grids)."""
    return prefill_func(qtype, n_out, k, prefill_body(qtype, n_out, k, rows))


def prefill_body(qtype: str, n_out: int, k: int, rows: int = ROWS):
    """The kernel's body, a macro `(x, w, out, table, tokens)` (see `prefill_func`)."""
    if k % LANES or n_out % COLS:
        raise ValueError(f"int8 prefill needs k % {LANES} == 0 and n % {COLS} == 0")
    groups = k // LANES
    rb = get_format(qtype).row_bytes(k)
    halves = offset_halves(qtype)
    quantize = quantize_macro(groups, halves)
    tile = int8_vnni.tile_macro(qtype, groups)

    @T.macro
    def body(x, w, out, table, tokens):
        # the decode macros' view: one row per token
        rows_in = T.decl_buffer((tokens, T.int64(1), k), "float32", data=x.data)
        rows_out = T.decl_buffer((tokens, T.int64(1), n_out), "float32", data=out.data)
        n_tiles = T.meta_var((tokens + rows - 1) // rows)
        padded = T.meta_var(n_tiles * rows)
        xq = T.sblock_alloc_buffer((tokens, k), "int8")
        # the codes again, by tile of rows, then group, then row: [tile, group, row, 32]
        xt = T.sblock_alloc_buffer((n_tiles * groups * rows * LANES,), "int8")
        xm = T.sblock_alloc_buffer((tokens, groups * MULT_LANES), "int16")
        xr = T.sblock_alloc_buffer((tokens,), "float32")
        xs = T.sblock_alloc_buffer((groups * halves, padded), "float32")
        steps = T.sblock_alloc_buffer((groups, padded), "float32")
        for r in T.parallel(tokens):
            with T.sblock("quantize"):
                T.reads(rows_in[r, 0, 0:k])
                T.writes(
                    xq[r, 0:k], xm[r, 0 : groups * MULT_LANES], xr[r], xs[:, r], steps[:, r], xt[:]
                )
                quantize(rows_in, r, xq, xm, xr, xs)
                for g in range(groups):
                    steps[g, r] = xr[r] * T.Cast("float32", xm[r, g * MULT_LANES])
                    at: T.let[T.int64] = (((r // rows) * groups + g) * rows + r % rows) * LANES
                    xt[T.Ramp(at, 1, LANES)] = xq[r, T.Ramp(g * LANES, 1, LANES)]
        for rt in range(n_tiles):
            for nb in T.parallel(n_out // COLS):
                with T.sblock("dot_vnni"):
                    T.reads(w[nb * COLS : nb * COLS + COLS, 0:rb], xt[:], steps[:, :], xs[:, :])
                    T.writes(rows_out[:, 0, nb * COLS : nb * COLS + COLS])
                    r0: T.let[T.int64] = rt * rows
                    n_rows: T.let[T.int64] = T.min(tokens - r0, rows)
                    # the tile's rows of the activations, steps and sums, each group's rows
                    # next to each other
                    xq_tile = T.decl_buffer(
                        (rows, groups, LANES),
                        "int8",
                        data=xt.data,
                        strides=[LANES, rows * LANES, 1],
                        elem_offset=rt * groups * rows * LANES,
                    )
                    steps_tile = T.decl_buffer(
                        (rows, groups),
                        "float32",
                        data=steps.data,
                        strides=[1, padded],
                        elem_offset=r0,
                    )
                    xs_tile = T.decl_buffer(
                        (groups * halves, rows),
                        "float32",
                        data=xs.data,
                        strides=[padded, 1],
                        elem_offset=r0,
                    )
                    # the tile's sums: a compact array (rows of `out` are a power of two
                    # apart, which maps them to a few L1 sets)
                    acc = T.sblock_alloc_buffer((rows, 1, COLS), "float32")
                    n0 = T.meta_var(nb * COLS)
                    if table is None:
                        tile(w, n0, 0, n_rows, xq_tile, steps_tile, xs_tile, acc, 0, 0)
                    else:  # (only the generic tiles take a table)
                        tile(w, n0, 0, n_rows, xq_tile, steps_tile, xs_tile, acc, 0, 0, table)
                    for r in range(n_rows):
                        rows_out[r0 + r, 0, T.Ramp(nb * COLS, 1, COLS)] = acc[
                            r, 0, T.Ramp(0, 1, COLS)
                        ]

    return body


def prefill_func(qtype: str, n_out: int, k: int, body):
    """The PrimFunc around a prefill kernel's `body` macro, `(x, w, out, table, tokens)`
    (x `[1, tokens, K]`, out `[1, tokens, n_out]`, `table` None for a format without one):
    the parameters of the `quant_matmul` it replaces, (x, w, out), or (x, w, table, out)
    for a format with a constant table (the lattice i-quants' grids)."""
    rb = get_format(qtype).row_bytes(k)
    if get_format(qtype).table is not None:  # a lattice format: its grid, a constant input
        size = len(get_format(qtype).table())

        @T.prim_func(s_tir=True, private=True)
        def gemm_table(
            x_handle: T.handle,
            w: T.Buffer((n_out, rb), "uint8"),
            table: T.Buffer((size,), "uint8"),
            out_handle: T.handle,
        ):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
            tokens = T.int64()
            x = T.match_buffer(x_handle, (T.int64(1), tokens, k), "float32")
            out = T.match_buffer(out_handle, (T.int64(1), tokens, n_out), "float32")
            body(x, w, out, table, tokens)

        return gemm_table

    @T.prim_func(s_tir=True, private=True)
    def gemm(x_handle: T.handle, w: T.Buffer((n_out, rb), "uint8"), out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        tokens = T.int64()
        x = T.match_buffer(x_handle, (T.int64(1), tokens, k), "float32")
        out = T.match_buffer(out_handle, (T.int64(1), tokens, n_out), "float32")
        body(x, w, out, None, tokens)

    return gemm


def prefill_kernel_for(func, vnni: bool = True, amx: bool = False):
    """The int8 prefill kernel replacing `func`, or None when `func` is not a quantized
    matmul over `[1, tokens, K]` with a symbolic token count or its format has no int8
    tiles on this CPU level. `vnni`: AVX-512 VNNI's tiles (this module), else AVX2's
    column tiles (`int8_prefill_columns`); `amx`: with AMX, `amx_prefill`'s bf16 tiles
    (which take these for calls of a few rows) where the output has whole 32 columns."""
    from tallow.compiler.quant import get_format as format_of
    from tallow.model_defs.quant_ops import QUANT_TYPE_ATTR

    from ..tir_common import static_extent
    from . import amx_prefill
    from . import int8_prefill_columns as columns

    if not func.attrs or QUANT_TYPE_ATTR not in func.attrs:
        return None
    qtype = str(func.attrs[QUANT_TYPE_ATTR])
    # a lattice format's grid comes as a third input (x, w, table, out), which both tile
    # families take
    with_table = format_of(qtype).table is not None
    if len(func.params) != (4 if with_table else 3):
        return None
    x, w, out = func.params[0], func.params[1], func.params[-1]  # (TVM 0.27: typed params)
    if len(x.shape) != 3 or static_extent(x.shape[0]) != 1 or len(w.shape) != 2:
        return None
    if static_extent(x.shape[1]) is not None:  # a static token count: decode's pass
        return None
    if str(x.dtype) != "float32" or str(out.dtype) != "float32":
        return None
    k, n = static_extent(x.shape[2]), static_extent(w.shape[0])
    cols = COLS if vnni else columns.COLS
    if k is None or n is None or k % LANES or n % cols:
        return None
    if format_of(qtype).int8 is None:
        return None
    if vnni and amx and n % amx_prefill.COLS == 0:
        return amx_prefill.amx_prefill_kernel(qtype, n, k)
    if vnni:
        return prefill_kernel(qtype, n, k)
    return columns.prefill_kernel(qtype, n, k) if columns.supported(qtype) else None
