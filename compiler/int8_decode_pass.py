"""Give the decode functions' quantized matmuls int8-activation kernels (x86 CPUs with AVX2).

The model emits every quantized linear layer as one fused dequantize-matmul PrimFunc, tagged
with its weight format (`model_defs.quant_ops.QUANT_TYPE_ATTR`). In `decode` and
`batch_decode` its input is `[batch, 1, K]`: one token per sequence. For those kernels this
pass substitutes `schedules.cpu.int8_gemv`'s hand-written kernel, with the same parameters
(x, w, out; x, w, table, out for a format with a constant table, the lattice grids:
`int8_codes.has_table`), before fusion: it is marked opaque, so fusion leaves it whole (an
epilogue such as a bias add stays a separate, small kernel). Prefill kernels (a symbolic
token axis) are `int8_prefill_pass`'s.

On CPUs with AVX-512 VNNI the batched kernels take `schedules.cpu.int8_vnni`'s column tiles
and `decode`'s one-row kernels `int8_vnni_row`'s (the same numbers, fewer instructions);
the manifest names the tiles
(`target.details.int8_decode_tiles`).

This changes decode's numerics in the way llama.cpp's do: activations are rounded to int8
per 32 before the product (Q8_0's rule, the scales kept as int16 multiples of a step per row:
see `schedules.cpu.int8_ops`). The manifest records it (`target.details.decode_activations`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backends.base import BuildReport

log = logging.getLogger(__name__)

# int8 codes per 32, each group's scale an int16 multiple of one step per row
ACTIVATIONS = "int8_g32_row_step"


def int8_kernel_for(func, vnni: bool = False):
    """The int8-activation kernel replacing `func`, or None when `func` is not a decode matmul."""
    from tallow.compiler.quant import get_format
    from tallow.model_defs.quant_ops import QUANT_TYPE_ATTR
    from tallow.schedules.cpu import int8_gemv
    from tallow.schedules.tir_common import static_extent

    if not func.attrs or QUANT_TYPE_ATTR not in func.attrs:
        return None
    qtype = str(func.attrs[QUANT_TYPE_ATTR])
    fmt = get_format(qtype)
    if fmt.int8 is None:  # a format without int8 groups keeps its kernel
        return None
    # (x, w, out), or (x, w, table, out) for a format with a constant table
    if len(func.params) != (3 if fmt.table is None else 4):
        return None
    x, w, out = func.params[0], func.params[1], func.params[-1]  # buffer shape and dtype
    if len(x.shape) != 3 or static_extent(x.shape[1]) != 1 or len(w.shape) != 2:
        return None
    if str(x.dtype) != "float32" or str(out.dtype) != "float32":
        return None
    k, n = static_extent(x.shape[2]), static_extent(w.shape[0])
    if k is None or n is None or k % int8_gemv.LANES or n % int8_gemv.N_CHUNK:
        return None
    return int8_gemv.gemv_kernel(qtype, n, k, static_extent(x.shape[0]), vnni=vnni)


def substitute_kernels(mod, kernel_for) -> int:
    """Put `kernel_for(func)` in place of every PrimFunc of `mod` it gives a kernel for (in
    place; the int8 decode and prefill passes); returns how many were replaced."""
    import tvm

    updated = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            kernel = kernel_for(func)
            if kernel is not None:
                updated[gv] = kernel
    for gv, kernel in updated.items():
        mod[gv] = kernel
    return len(updated)


def int8_decode_kernels(report: BuildReport, vnni: bool = False):
    """The module pass; records the kernels it replaced in `report`. `vnni`: the target
    has AVX-512 VNNI (`schedules.cpu.int8_vnni.supported`)."""
    import tvm

    from tallow.model_defs.quant_ops import QUANT_TYPE_ATTR

    @tvm.transform.module_pass(opt_level=0, name="tallow.Int8DecodeKernels")
    def _pass(mod, _ctx):
        float_dtype = next(  # what decode's matmuls read when none is replaced (f16/bf16 too)
            (
                str(f.params[0].dtype)
                for _, f in mod.functions_items()
                if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and QUANT_TYPE_ATTR in f.attrs
            ),
            "float32",
        )
        replaced = substitute_kernels(mod, lambda func: int8_kernel_for(func, vnni))
        report.decode_activations = ACTIVATIONS if replaced else float_dtype
        report.int8_decode_kernels = replaced
        if replaced:
            report.int8_decode_tiles = "avx512-vnni" if vnni else "avx2"
        log.info("int8-activation decode kernels: %d", replaced)
        return mod

    return _pass
