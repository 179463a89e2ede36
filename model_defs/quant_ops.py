"""Dequantizing TE expressions and nn modules for the registered weight block formats.

Physical layout: the weight is exactly the GGUF tensor data, ``uint8[rows, row_bytes]`` with
``row_bytes = cols / block_size * type_size``; no repacking, so the weight converter can copy
the bytes straight from a .gguf file (or from ``tallow.compiler.quant.quantize``).

Each format's block size and TIR byte decoder come from the quant format registry
(``tallow.compiler.quant.get_format``); the block layouts are documented with the decoders
(``compiler/quant/<family>/tir_decode.py``). A decoder reads bytes through a
``byte(offset_in_block)`` callback, so the same expression serves the full-matrix
dequantization, the fused matmul and the embedding lookup (which reads the blocks of
looked-up rows only). The decoders are bit-exact with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from tvm import te
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from tallow.compiler.quant.registry import get_format


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one `qtype` row of `cols` weights (checks that `cols` fills whole blocks)."""
    return get_format(qtype).row_bytes(cols)


def dequant_value(
    read: Callable, qtype: str, col, out_dtype: str = "float32", table: te.Tensor | None = None
):
    """Weight `col` of a row whose bytes are `read(byte_index_in_row)` (uint8 expressions);
    `table`: the format's constant table (`QuantFormat.table`, see `table_tensor`)."""
    fmt = get_format(qtype)
    base = col // fmt.block_size * fmt.type_size

    def byte(off):
        return read(base + off).astype("int32")

    # int32 lane arithmetic: with int64 (the index type nn uses) the vectorised shifts and
    # masks would run on half-width vectors.
    j = col % fmt.block_size
    j = j.astype("int32") if hasattr(j, "astype") else j
    if fmt.table is None:
        value = fmt.tir_decode(byte, j)
    elif table is None:
        raise ValueError(f"{qtype} decodes through a constant table: pass it (table_tensor)")
    else:
        value = fmt.tir_decode(byte, j, lambda i: table[i].astype("int32"))
    return value if out_dtype == "float32" else value.astype(out_dtype)


def dequantize_te(
    blocks: te.Tensor,
    qtype: str,
    rows: int,
    cols: int,
    out_dtype: str = "float32",
    table: te.Tensor | None = None,
) -> te.Tensor:
    """uint8 [rows, row_bytes] GGUF blocks -> out_dtype [rows, cols], a block "dequantize"."""
    row_bytes(qtype, cols)  # validates qtype and cols
    return te.compute(
        (rows, cols),
        lambda r, c: dequant_value(lambda b: blocks[r, b], qtype, c, out_dtype, table),
        name="dequantize",
    )


def table_tensor(qtype: str) -> Tensor | None:
    """The format's constant table (`QuantFormat.table`: the lattice i-quants' grids) as a
    Relax constant, the kernels' extra input; None for a format without one. One constant
    per format and build (cached on its data), so the library holds it once."""
    fmt = get_format(qtype)
    return None if fmt.table is None else Tensor(_expr=_table_constant(qtype))


@functools.cache
def _table_constant(qtype: str):
    from tvm import relax

    return relax.const(get_format(qtype).table(), "uint8")


# Half-precision kernels sum their products in float32 (llama.cpp's and MLC's GPU kernels do
# too): an f16 running sum over K = 4096 products loses about log2(4096)/2 = 6 of its 11
# bits, while the f32 sum keeps the result within one f16 rounding of the exact product.
ACCUMULATE = "float32"


def quant_matmul_te(
    x: te.Tensor, w: te.Tensor, qtype: str, n: int, out_dtype: str, table: te.Tensor | None = None
):
    """x [..., K] @ dequantize(w)^T -> [..., n]: one PrimFunc holding dequantize + matmul.

    The weights dequantize to the compute dtype `out_dtype` (what tensor cores and the
    activations take: a weight is gguf's f32 value rounded once to f16/bf16) and the products
    accumulate in float32; a half-precision result is then rounded once (a "cast" epilogue).
    """
    k_dim = int(x.shape[-1])
    deq = dequantize_te(w, qtype, n, k_dim, out_dtype, table)
    k = te.reduce_axis((0, k_dim), name="k")
    shape = (*x.shape[:-1], n)
    if out_dtype == ACCUMULATE:
        return te.compute(
            shape, lambda *i: te.sum(x[(*i[:-1], k)] * deq[i[-1], k], axis=k), name="matmul"
        )
    acc = te.compute(
        shape,
        lambda *i: te.sum(
            x[(*i[:-1], k)].astype(ACCUMULATE) * deq[i[-1], k].astype(ACCUMULATE), axis=k
        ),
        name="matmul",
    )
    return te.compute(shape, lambda *i: acc[i].astype(out_dtype), name="cast")


# PrimFunc attribute naming a fused dequantize-matmul's weight format, so that later passes
# (the CPU's int8-activation decode kernels) can find these kernels without parsing names.
QUANT_TYPE_ATTR = "tallow.quant_type"
OUT_ELEMWISE_FUSABLE = 4  # relax's OpPatternKind kOutEWiseFusable


def quant_matmul(x: Tensor, w: Tensor, qtype: str, n: int, out_dtype: str) -> Tensor:
    """`x @ dequantize(w)^T` as one `tensor_expr_op`, tagged with its format (a format with
    a constant table takes it as a third input: `table_tensor`)."""
    table = table_tensor(qtype)
    attrs = {QUANT_TYPE_ATTR: qtype}
    if table is not None:
        # a matmul with elementwise-fusable outputs, as the other formats' kernels are found
        # to be; the analysis would call it opaque (a load indexed by another load's value)
        # and FuseOps would leave the epilogues (residual add) in kernels of their own
        attrs["op_pattern"] = OUT_ELEMWISE_FUSABLE
    return op.tensor_expr_op(
        lambda xt, wt, *tt: quant_matmul_te(xt, wt, qtype, n, out_dtype, *tt),
        name_hint=f"quant_matmul_{qtype}",
        args=[x, w] if table is None else [x, w, table],
        attrs=attrs,
    )


class QuantLinear(nn.Module):
    """`y = x @ W^T` with W stored as GGUF blocks (parameter `weight`, uint8 [out, row_bytes]).

    The dequantization and the matmul are one `tensor_expr_op`, so they are born as one
    PrimFunc: no fusion pass is needed and W is never materialised in full precision once
    `tallow.schedules.cpu.quant` (or dlight, which recognises the "dequantize" block) has put
    the dequantize block inside the reduction loop.
    """

    def __init__(self, in_features: int, out_features: int, qtype: str, out_dtype="float32"):
        self.in_features = in_features
        self.out_features = out_features
        self.qtype = qtype
        self.out_dtype = out_dtype
        self.weight = nn.Parameter((out_features, row_bytes(qtype, in_features)), dtype="uint8")

    def forward(self, x: Tensor) -> Tensor:
        return quant_matmul(x, self.weight, self.qtype, self.out_features, self.out_dtype)


class QuantEmbedding(nn.Module):
    """Embedding table as GGUF blocks; dequantizes only the looked-up rows (take, then decode)."""

    def __init__(self, num: int, dim: int, qtype: str, out_dtype: str = "float32"):
        self.num = num
        self.dim = dim
        self.qtype = qtype
        self.out_dtype = out_dtype
        self.weight = nn.Parameter((num, row_bytes(qtype, dim)), dtype="uint8")

    def forward(self, ids: Tensor) -> Tensor:
        qtype, dim, dt = self.qtype, self.dim, self.out_dtype

        def compute(idt: te.Tensor, wt: te.Tensor, *tt: te.Tensor) -> te.Tensor:
            return te.compute(
                (*idt.shape, dim),
                lambda *i: dequant_value(lambda b: wt[idt[i[:-1]], b], qtype, i[-1], dt, *tt),
                name="dequantize",
            )

        table = table_tensor(qtype)
        args = [ids, self.weight] if table is None else [ids, self.weight, table]
        return op.tensor_expr_op(compute, name_hint=f"quant_embedding_{qtype}", args=args)
