"""llama.cpp's block types without a lookup grid: the ternary TQ1_0 (1.69 bits a weight) and
TQ2_0 (2.06; BitNet b1.58-style models), the microscaling MXFP4 (4.25; gpt-oss) and NVFP4
(4.5: an E4M3 scale per 16 weights, NVIDIA's FP4), and the 1-bit Q1_0 (1.125: a sign bit
per weight, an f16 scale per 128).

Registers them in `tallow.compiler.quant.registry`: numpy codec (decoders and quantizers,
no importance matrix needed) in `numpy_codec`, TIR byte decoders in `tir_decode`, int8-kernel
groups in `int8_groups` (imported on first use, see `QuantFormat`). A TQ weight whose rows
hold no whole 256-weight block takes q4_0, as llama.cpp's `quantize` does; MXFP4's 32-weight
block has no smaller fallback.

Int8 kernels: mxfp4 (the doubled E2M1 values as signed codes, one `vpshufb`, as the
i-quants') takes the row tiles in decode (signed codes: no column tiles there; prefill takes
them through a sign trick, `int8_prefill_columns`); tq1_0 and tq2_0 have none
(`int8_groups` says why) and run the float fused dequantize-matmul. Measured (2048 x 2048
decode matmul, one row, 1 thread, 2-core Zen 3): mxfp4's int8 row kernel 0.22 ms (q4_0's
0.18; `benchmarks/decode_matmul.py`); float fused kernel (CPU time, weights in cache)
tq2_0 1.85 ms, tq1_0 8.1 ms (its digit arithmetic and selected byte gather), mxfp4 4.2,
against q4_0 1.36 and q4k 2.97 on that kernel.

Q1_0 and NVFP4 have int8 kernels too: Q1_0's sign bits as codes 0 / 1 with scale 2d and
offset -d, NVFP4's nibbles through the E2M1 table with one scale per 16-weight half.
Measured the same way (CPU time, `decode_matmul.py --clock cpu`, 2026-12-06, loaded
machine): int8 row kernel q1_0 0.157 ms, nvfp4 0.545 ms (a group's two scales decoded one
at a time), against q4_0 0.186 and mxfp4 0.224; their float fused kernels 2.41 and 4.24 ms.

GPU: tq2_0, q1_0 and nvfp4 go through the GPU schedules (checked on OpenCL/PoCL by
`test_opencl_kernels`). tq1_0 and mxfp4 do not yet (`QuantFormat.gpu`: a GPU compile
refuses them): their scheduled kernels read bytes at offsets the vectoriser cannot prove
contiguous (tq1_0's selected byte, MXFP4's 17-byte blocks), and TVM 0.27's OpenCL code for
such a 2-lane byte gather (`convert_int2` of a scalar) does not compile on PoCL.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as GGML

from .. import iquants  # noqa: F401 - the older families first: they list before ours
from ..format import Int8Codes, Lazy, QuantFormat
from ..registry import register_format
from . import numpy_codec as codec

_TIR = f"{__name__}.tir_decode"
_INT8 = f"{__name__}.int8_groups"


def _lowbit(name, ggml_type, block_size, type_size, fallback, int8, gpu) -> QuantFormat:
    return QuantFormat(
        name=name,
        ggml_type=ggml_type,
        block_size=block_size,
        type_size=type_size,
        quantize_blocks=getattr(codec, f"quantize_{name}"),
        dequantize_blocks=getattr(codec, f"dequantize_{name}"),
        tir_decode=Lazy(_TIR, name),
        fallback=fallback,
        int8=int8,
        gpu=gpu,
    )


_Q1_0_INT8 = Int8Codes(Lazy(_INT8, "q1_0"), max_code=1)
_NVFP4_INT8 = Int8Codes(Lazy(_INT8, "nvfp4"), signed=True, split_halves=True)

for _fmt in (
    _lowbit("tq1_0", GGML.TQ1_0, 256, 54, "q4_0", None, gpu=False),
    _lowbit("tq2_0", GGML.TQ2_0, 256, 66, "q4_0", None, gpu=True),
    _lowbit("mxfp4", GGML.MXFP4, 32, 17, None, Int8Codes(Lazy(_INT8, "mxfp4"), signed=True), False),
    _lowbit("q1_0", GGML.Q1_0, 128, 18, None, _Q1_0_INT8, gpu=True),
    _lowbit("nvfp4", GGML.NVFP4, 64, 36, None, _NVFP4_INT8, gpu=True),
):
    register_format(_fmt)
