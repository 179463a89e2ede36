"""llama.cpp's legacy 32-weight block formats q8_0, q4_0, q4_1, q5_0 and q5_1.

Registers them in `tallow.compiler.quant.registry`: numpy codec in `numpy_codec`, TIR byte
decoders in `tir_decode`, int8-kernel groups in `int8_groups` (the last two imported on
first use, see `QuantFormat`).

Column tiles (`column_tiles`: AVX2 `batch_decode` takes them at every batch size;
`benchmarks/decode_matmul.py --tiles`, one thread, CPU time, weights from memory, against
the row tiles): q4_0 and q4_1 take 0.60-1.00x the row tiles' time from 1 to 8 sequences
(2048 x 1024; SmolLM2's 3072 x 576 q4_1 0.55-0.89x), 0.66-0.70x at 12 and 16. q5_0 and q5_1
(their fifth bits cost a shuffle per column) and q8_0 (its sign trick costs an instruction
per step) did not gain, and keep the row tiles.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as GGML

from ..format import Int8Codes, Lazy, LeadingScale, QuantFormat
from ..registry import register_format
from . import numpy_codec as codec

_TIR = f"{__name__}.tir_decode"
_INT8 = f"{__name__}.int8_groups"


def _legacy(name, ggml_type, type_size, **int8) -> QuantFormat:
    return QuantFormat(
        name=name,
        ggml_type=ggml_type,
        block_size=32,
        type_size=type_size,
        quantize_blocks=getattr(codec, f"quantize_{name}"),
        dequantize_blocks=getattr(codec, f"dequantize_{name}"),
        tir_decode=Lazy(_TIR, name),
        fallback=None,  # nothing smaller than 32 weights: other row lengths stay float
        int8=Int8Codes(group=Lazy(_INT8, name), **int8),
    )


for _fmt in (
    _legacy("q8_0", GGML.Q8_0, 34, signed=True, leading_scale=LeadingScale(-128.0)),
    _legacy(
        "q4_0",
        GGML.Q4_0,
        18,
        max_code=15,
        column_tiles=True,
        nibble_codes_at=2,
        leading_scale=LeadingScale(-8.0),
    ),
    _legacy(
        "q4_1",
        GGML.Q4_1,
        20,
        max_code=15,
        column_tiles=True,
        nibble_codes_at=4,
        leading_scale=LeadingScale(None),
    ),
    _legacy(
        "q5_0",
        GGML.Q5_0,
        22,
        max_code=31,  # column tiles in prefill only (decode keeps the row tiles)
        nibble_codes_at=6,
        fifth_bits_at=2,
        leading_scale=LeadingScale(-16.0),
    ),
    _legacy(
        "q5_1",
        GGML.Q5_1,
        24,
        max_code=31,  # column tiles in prefill only (decode keeps the row tiles)
        nibble_codes_at=8,
        fifth_bits_at=4,
        leading_scale=LeadingScale(None),
    ),
):
    register_format(_fmt)
