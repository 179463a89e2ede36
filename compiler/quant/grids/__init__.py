"""llama.cpp's lattice i-quants: IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS, IQ1_S, IQ1_M.

Each stores groups of 8 (IQ3: 4) weights as an index into a fixed grid of 256 to 2048
lattice points (`tables`, taken from the `gguf` package), with sign bits and small scales
under one f16. These are what llama.cpp's IQ3_M / IQ2_M / IQ1_M and the "dynamic" GGUFs put
in most layers. Registers them in `tallow.compiler.quant.registry`: decoders written once
for numpy and TIR in `decoders` (run by `numpy_codec` and `tir_decode`), the grid handed to
the fused kernels as a constant uint8 parameter (`QuantFormat.table`; `tir_decode` says
why that way).

What runs: on the CPU, the int8-activation kernels of `decode` (the AVX2 row kernels,
`int8_groups`: every type but iq1_m, whose grid shift changes every 8 weights; iq3_s's takes
`schedules.cpu.int8_grid_row`'s, on both levels: `GridCodes`), `batch_decode`'s column tiles
(`column_tiles`: AVX2's, or AVX-512 VNNI's where the CPU has it; they were the row kernels'
until 2026-12-07: a 3072 -> 8192 projection, 2 threads, Intel Xeon, weights from memory,
row tiles -> AVX2 column tiles (both built for x86-64-v3) -> VNNI tiles at 1 / 4 / 16
sequences, ms: iq3_s 4.7 / 6.2 /
18.2 -> 4.2 / 4.9 / 7.1 -> 5.6 / 5.9 / 7.4, iq3_xxs 6.3 / 7.9 / 18.8 -> 5.7 / 6.8 / 10.6 ->
4.5 / 4.7 / 6.1, iq2_xs 6.5 / 7.7 / 19.9 -> 4.9 / 6.1 / 10.3 -> 5.9 / 6.5 / 8.3, iq2_s 4.1 /
5.7 / 17.5 -> 2.7 / 4.0 / 8.3 -> 4.1 / 4.7 / 6.5, iq1_s 3.6 / 4.9 / 14.1 -> 2.2 / 2.9 / 5.5 ->
4.3 / 4.6 / 6.2; the AVX2 tiles built for an AVX-512 target ran slower than the VNNI ones),
prefill's int8 tiles on both levels (`int8_prefill`, `int8_prefill_columns`: the grid passed
along), and the float fused dequantize-matmul elsewhere (the embedding); not the MoE
grouped kernels nor the GPU schedules, which refuse these types when compiling.
Measured (2048 x 2048 decode matmul, one row, 1 thread, weights in cache, AMD EPYC Zen 3,
`benchmarks/lattice_decode.py`), float -> int8 kernel: iq3_s 4.87 -> 0.67 ms, iq3_xxs
5.39 -> 0.89, iq2_s 1.28 -> 0.59, iq2_xs 1.53 -> 1.09, iq2_xxs 1.53 -> 0.85, iq1_s
0.80 -> 0.71 (iq1_m 1.07, float); q4_0 0.66 -> 0.18, q4k 1.37 -> 0.17 in the same rounds.
An IQ3_M file's decode went from 0.43x llama.cpp's to 1.17x (docs/benchmarks.md); its
`batch_decode` step for 4 sequences from 31-32 ms to 16.3-16.6 ms (2 threads, shared).

Written: iq3_s and iq3_xxs (`quantize_iq3_s`, `quantize_iq3_xxs`, one grid search in
`lattice_search`: `--quant iq3_s` / `iq3_m` (llama.cpp's recipes, `quant.mixes`) and `iq3_xxs`
(every weight); a row length that is not a multiple of 256 takes iq4_nl, llama.cpp's fallback
for its i-quants). The others have no
quantizer, so no `--quant` mix (`QuantFormat.no_quantizer`, `--quant` refuses in one line):
llama.cpp's recipes for IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M need an importance matrix,
which tallow does not compute. Read only, they need no fallback: llama.cpp's files store such
tensors in another type themselves.
"""

from __future__ import annotations

from functools import partial

from gguf import GGMLQuantizationType as GGML

from .. import lowbit  # noqa: F401 - the older families first: they list before ours
from ..format import GridCodes, Int8Codes, Lazy, QuantFormat
from ..registry import register_format
from . import numpy_codec as codec
from .tables import grid_bytes

_TIR = f"{__name__}.tir_decode"
_INT8 = f"{__name__}.int8_groups"
NEEDS_IMATRIX = (
    "llama.cpp's recipe for it needs an importance matrix (llama-quantize --imatrix), which "
    "tallow does not compute"
)


def _grid_format(
    name, ggml_type, type_size, no_quantizer, int8=True, halves=False, grid_codes=None
):
    # written by tallow (`no_quantizer` None): a quantizer module of its own, and llama.cpp's
    # fallback for a row length that is not a multiple of 256, iq4_nl
    written = no_quantizer is None
    return QuantFormat(
        gpu=False,
        name=name,
        ggml_type=ggml_type,
        block_size=256,
        type_size=type_size,
        quantize_blocks=Lazy(f"{__name__}.quantize_{name}", f"quantize_{name}")
        if written
        else None,
        fallback="iq4_nl" if written else None,
        dequantize_blocks=codec.decoder(name),
        tir_decode=Lazy(_TIR, name),
        table=partial(grid_bytes, name),
        no_quantizer=no_quantizer,
        int8=Int8Codes(
            group=Lazy(_INT8, name),
            signed=True,
            split_halves=halves,
            grid_codes=grid_codes,
            column_tiles=True,
        )
        if int8
        else None,
    )


for _fmt in (
    _grid_format(
        "iq3_s",
        GGML.IQ3_S,
        110,
        None,
        grid_codes=GridCodes(Lazy(_INT8, "iq3_s_indices"), 74, Lazy(_INT8, "iq3_s_group_scales")),
    ),
    _grid_format("iq3_xxs", GGML.IQ3_XXS, 98, None),
    _grid_format("iq2_s", GGML.IQ2_S, 82, NEEDS_IMATRIX, halves=True),
    _grid_format("iq2_xs", GGML.IQ2_XS, 74, NEEDS_IMATRIX, halves=True),
    _grid_format("iq2_xxs", GGML.IQ2_XXS, 66, NEEDS_IMATRIX),
    _grid_format("iq1_s", GGML.IQ1_S, 50, NEEDS_IMATRIX),
    # a scale per 16 weights and the grid's shift per 8: no group form (float kernel)
    _grid_format("iq1_m", GGML.IQ1_M, 56, NEEDS_IMATRIX, int8=False),
):
    register_format(_fmt)
