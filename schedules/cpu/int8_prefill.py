"""Prefill matmuls for quantized weights on CPUs with AVX-512 VNNI: int8 activations.

Prefill (`[1, tokens, K]` times a quantized `[N, K]` weight) used float activations and the
tiled schedule of `cpu.tiled`: a chunk of weight rows decoded to float once, then 8-lane
FMAs, one per 8 multiply-adds. llama.cpp quantizes the activations to 8 bits and runs
integer dot products for every format; on AVX-512 VNNI a `vpdpbusd` does 64 multiply-adds.
This kernel does the same with the batched-decode machinery, whose 16-column tiles
(`int8_vnni`) are a GEMM already: a tile transposes one group of 16 weight rows' codes once
and serves up to 16 token rows with it.

* every token row is quantized as `int8_ops` documents (in parallel over rows), the same
  numbers `batch_decode` uses for the same row: prefill and decode round alike;
* the output columns run on the thread pool in blocks of 16, each block over all tokens in
  tiles of 16 rows (a block's weights stay in L1 across its row tiles).

The token axis is the second of `[1, tokens, K]`; the decode macros index `[rows, 1, K]`,
which is the same memory, so the kernel declares that view of `x` and `out`.

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
ROWS = int8_vnni.ROWS  # token rows sharing one transposed group of codes


def prefill_kernel(qtype: str, n_out: int, k: int):
    """`out[0, t, :] = x[0, t, :] @ dequantize(w)^T` for a symbolic token count.

    Same parameters as the `quant_matmul` PrimFunc it replaces: (x, w, out)."""
    if k % LANES or n_out % COLS:
        raise ValueError(f"int8 prefill needs k % {LANES} == 0 and n % {COLS} == 0")
    groups = k // LANES
    rb = get_format(qtype).row_bytes(k)
    halves = offset_halves(qtype)
    quantize = quantize_macro(groups, halves)
    tile = int8_vnni.tile_macro(qtype, groups)

    @T.prim_func(s_tir=True, private=True)
    def gemm(x_handle: T.handle, w: T.Buffer((n_out, rb), "uint8"), out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        tokens = T.int64()
        x = T.match_buffer(x_handle, (T.int64(1), tokens, k), "float32")
        out = T.match_buffer(out_handle, (T.int64(1), tokens, n_out), "float32")
        # the decode macros' view: one row per token
        rows_in = T.decl_buffer((tokens, T.int64(1), k), "float32", data=x.data)
        rows_out = T.decl_buffer((tokens, T.int64(1), n_out), "float32", data=out.data)
        xq = T.sblock_alloc_buffer((tokens, k), "int8")
        xm = T.sblock_alloc_buffer((tokens, groups * MULT_LANES), "int16")
        xr = T.sblock_alloc_buffer((tokens,), "float32")
        xs = T.sblock_alloc_buffer((groups * halves, tokens), "float32")
        steps = T.sblock_alloc_buffer((tokens, groups), "float32")
        for r in T.parallel(tokens):
            with T.sblock("quantize"):
                T.reads(rows_in[r, 0, 0:k])
                T.writes(xq[r, 0:k], xm[r, 0 : groups * MULT_LANES], xr[r], xs[:, r], steps[r, :])
                quantize(rows_in, r, xq, xm, xr, xs)
                for g in range(groups):
                    steps[r, g] = xr[r] * T.Cast("float32", xm[r, g * MULT_LANES])
        for nb in T.parallel(n_out // COLS):
            for rt in range((tokens + ROWS - 1) // ROWS):
                with T.sblock("dot_vnni"):
                    T.reads(w[nb * COLS : nb * COLS + COLS, 0:rb], xq[:, :], steps[:, :], xs[:, :])
                    T.writes(rows_out[:, 0, nb * COLS : nb * COLS + COLS])
                    r0: T.let[T.int64] = rt * ROWS
                    n_rows: T.let[T.int64] = T.min(tokens - r0, ROWS)
                    tile(w, nb * COLS, r0, n_rows, xq, steps, xs, rows_out)

    return gemm


def prefill_kernel_for(func):
    """The int8 prefill kernel replacing `func`, or None when `func` is not a quantized
    matmul over `[1, tokens, K]` with a symbolic token count."""
    from tallow.compiler.quant import get_format as format_of
    from tallow.model_defs.quant_ops import QUANT_TYPE_ATTR

    from ..tir_common import static_extent

    if not func.attrs or QUANT_TYPE_ATTR not in func.attrs or len(func.params) != 3:
        return None
    x, w, out = func.params  # TVM 0.27: parameters carry their buffer shape and dtype
    if len(x.shape) != 3 or static_extent(x.shape[0]) != 1 or len(w.shape) != 2:
        return None
    if static_extent(x.shape[1]) is not None:  # a static token count: decode's pass
        return None
    if str(x.dtype) != "float32" or str(out.dtype) != "float32":
        return None
    k, n = static_extent(x.shape[2]), static_extent(w.shape[0])
    if k is None or n is None or k % LANES or n % COLS:
        return None
    qtype = str(func.attrs[QUANT_TYPE_ATTR])
    if format_of(qtype).int8 is None:
        return None
    return prefill_kernel(qtype, n, k)
