"""llama.cpp's lattice i-quants: IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS, IQ1_S, IQ1_M.

Each stores groups of 8 (IQ3: 4) weights as an index into a fixed grid of 256 to 2048
lattice points (`tables`, taken from the `gguf` package), with sign bits and small scales
under one f16. These are what llama.cpp's IQ3_M / IQ2_M / IQ1_M and the "dynamic" GGUFs put
in most layers. Registers them in `tallow.compiler.quant.registry`: decoders written once
for numpy and TIR in `decoders` (run by `numpy_codec` and `tir_decode`), the grid handed to
the fused kernels as a constant uint8 parameter (`QuantFormat.table`; `tir_decode` says
why that way).

What runs: the CPU's float fused dequantize-matmul (no int8-activation groups: a code is a
grid lookup per 8 weights, which the int8 tiles' vector code-unpacking does not express),
dense layers, the embedding and the head; not the MoE grouped kernels nor the GPU
schedules, which refuse these types when compiling. No quantizer, so no `--quant` mix:
llama.cpp's own recipes for IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M need an importance
matrix, and a grid search without one is not what these files hold. A row length that is
not a multiple of 256 has no fallback here: llama.cpp's files store such tensors in another
type themselves.
"""

from __future__ import annotations

from functools import partial

from gguf import GGMLQuantizationType as GGML

from .. import lowbit  # noqa: F401 - the older families first: they list before ours
from ..format import Lazy, QuantFormat
from ..registry import register_format
from . import numpy_codec as codec
from .tables import grid_bytes

_TIR = f"{__name__}.tir_decode"
NEEDS_IMATRIX = (
    "llama.cpp's recipe for it needs an importance matrix (llama-quantize --imatrix), which "
    "tallow does not compute"
)
NOT_WRITTEN = "tallow reads and runs it but has no grid-search quantizer for it (yet)"


def _grid_format(name, ggml_type, type_size, no_quantizer) -> QuantFormat:
    return QuantFormat(
        gpu=False,
        name=name,
        ggml_type=ggml_type,
        block_size=256,
        type_size=type_size,
        quantize_blocks=None,
        dequantize_blocks=codec.decoder(name),
        tir_decode=Lazy(_TIR, name),
        table=partial(grid_bytes, name),
        no_quantizer=no_quantizer,
    )


for _fmt in (
    _grid_format("iq3_s", GGML.IQ3_S, 110, NOT_WRITTEN),
    _grid_format("iq3_xxs", GGML.IQ3_XXS, 98, NOT_WRITTEN),
    _grid_format("iq2_s", GGML.IQ2_S, 82, NEEDS_IMATRIX),
    _grid_format("iq2_xs", GGML.IQ2_XS, 74, NEEDS_IMATRIX),
    _grid_format("iq2_xxs", GGML.IQ2_XXS, 66, NEEDS_IMATRIX),
    _grid_format("iq1_s", GGML.IQ1_S, 50, NEEDS_IMATRIX),
    _grid_format("iq1_m", GGML.IQ1_M, 56, NEEDS_IMATRIX),
):
    register_format(_fmt)
