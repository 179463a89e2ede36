"""llama.cpp's K-quants: 256-weight super-block formats q2k, q3k, q4k, q5k and q6k.

Registers them in `tallow.compiler.quant.registry`: numpy codec in `numpy_codec` (scale
search in `scale_search`), TIR byte decoders in `tir_decode`, int8-kernel groups in
`int8_groups` (the last two imported on first use, see `QuantFormat`).

Fallbacks (a row length not a multiple of 256) are llama.cpp's: q2k/q3k -> q4_0,
q4k -> q5_0, q5k -> q5_1, q6k -> q8_0.

Column tiles (`column_tiles`: AVX2 `batch_decode` takes them at every batch size;
`benchmarks/decode_matmul.py --tiles`, one thread, CPU time, 2048 x 1024, weights from
memory, time against the row tiles'): from 1 to 8 sequences q2k 0.53-0.88x, q4k 0.49-0.93x,
q6k 0.62-1.06x and q3k 0.65-1.10x (the most at 1, 4 and 8), q5k 0.74-1.21x (1.12-1.21x at 1
to 4 and 8, 0.74x at 5 to 7); at 12 and 16 all 0.62-0.81x.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as GGML

from .. import legacy  # noqa: F401 - registers the legacy formats, our fallbacks
from ..format import Int8Codes, IntBlockScales, Lazy, QuantFormat
from ..registry import register_format
from . import numpy_codec as codec

_TIR = f"{__name__}.tir_decode"
_INT8 = f"{__name__}.int8_groups"


def _kquant(name, ggml_type, type_size, fallback, vector_scales=True, **int8) -> QuantFormat:
    return QuantFormat(
        name=name,
        ggml_type=ggml_type,
        block_size=256,
        type_size=type_size,
        quantize_blocks=getattr(codec, f"quantize_{name}"),
        dequantize_blocks=getattr(codec, f"dequantize_{name}"),
        tir_decode=Lazy(_TIR, name),
        fallback=fallback,
        int8=Int8Codes(
            group=Lazy(_INT8, name),
            block_scales=Lazy(_INT8, f"{name}_block_scales") if vector_scales else None,
            **int8,
        ),
    )


# q4k / q5k sub-scales are 6-bit integers under the block's f16 d
_K4_INT_SCALES = IntBlockScales(decode=Lazy(_INT8, "k4_int_scales"), largest=63)

# split_halves: 16-weight sub-blocks, so the two halves of a 32-weight group differ.
for _fmt in (
    _kquant("q2k", GGML.Q2_K, 84, "q4_0", split_halves=True, max_code=3, column_tiles=True),
    _kquant("q3k", GGML.Q3_K, 110, "q4_0", False, split_halves=True, max_code=7, column_tiles=True),
    _kquant(
        "q4k",
        GGML.Q4_K,
        144,
        "q5_0",
        max_code=15,
        column_tiles=True,
        nibble_pairs_at=16,
        int_block_scales=_K4_INT_SCALES,
    ),
    _kquant(
        "q5k",
        GGML.Q5_K,
        176,
        "q5_1",
        max_code=31,
        column_tiles=True,
        int_block_scales=_K4_INT_SCALES,
    ),
    _kquant(
        "q6k",
        GGML.Q6_K,
        210,
        "q8_0",
        split_halves=True,
        max_code=63,
        column_tiles=True,
        six_bit_at=(0, 128),
    ),
):
    register_format(_fmt)
