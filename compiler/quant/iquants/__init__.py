"""llama.cpp's 4-bit i-quants with a non-linear table: iq4_nl (32-weight blocks) and iq4_xs
(256-weight super-blocks of 6-bit group scales).

Registers them in `tallow.compiler.quant.registry`: numpy codec in `numpy_codec`, TIR byte
decoders in `tir_decode`, int8-kernel groups in `int8_groups` (the last two imported on
first use, see `QuantFormat`). iq4_xs falls back to iq4_nl for a row length not a multiple
of 256, as llama.cpp's `quantize` does.

Int8 kernels: the codes are the table values as int8 (`signed`, see `int8_groups`), so the
row tiles serve every batch size on AVX2 (no `column_tiles`: their int16 sums do not hold
unsigned codes up to 241). iq4_nl's f16 scale leads its block as q8_0's does
(`LeadingScale(-128)`: the VNNI tiles' flip to `code + 128`), so it takes the VNNI paths of
the legacy formats.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as GGML

from .. import kquants  # noqa: F401 - the older families first: they list before ours
from ..format import Int8Codes, Lazy, LeadingScale, QuantFormat, TableNibbles
from ..registry import register_format
from . import numpy_codec as codec

_TIR = f"{__name__}.tir_decode"
_INT8 = f"{__name__}.int8_groups"


def _iquant(name, ggml_type, block_size, type_size, fallback, **int8) -> QuantFormat:
    return QuantFormat(
        name=name,
        ggml_type=ggml_type,
        block_size=block_size,
        type_size=type_size,
        quantize_blocks=getattr(codec, f"quantize_{name}"),
        dequantize_blocks=getattr(codec, f"dequantize_{name}"),
        tir_decode=Lazy(_TIR, name),
        fallback=fallback,
        int8=Int8Codes(group=Lazy(_INT8, name), signed=True, **int8),
    )


for _fmt in (
    _iquant("iq4_nl", GGML.IQ4_NL, 32, 18, None, leading_scale=LeadingScale(-128.0)),
    _iquant(
        "iq4_xs",
        GGML.IQ4_XS,
        256,
        136,
        "iq4_nl",
        table_nibbles=TableNibbles(codec.TABLE, 8, Lazy(_INT8, "iq4_xs_group_scales")),
    ),
):
    register_format(_fmt)
