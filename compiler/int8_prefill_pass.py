"""Give the prefill functions' quantized matmuls int8-activation kernels (x86 with AVX2).

`prefill` and `batch_prefill` multiply `[1, tokens, K]` (a symbolic token count) by every
quantized weight. Float activations and the tiled dequantize-matmul (`schedules.cpu.tiled`)
reach about 8 multiply-adds per instruction; with AVX-512 VNNI, `schedules.cpu.int8_prefill`'s
kernel (the batched-decode VNNI tiles over the token rows) about 64 per `vpdpbusd`; with AVX2,
`schedules.cpu.int8_prefill_columns`' (batched decode's column tiles) 16 per `pmaddubsw`.
Like `int8_decode_pass`, this substitutes the kernel (same parameters: x, w, out) before
fusion, marked opaque, for the kernels whose format has int8 tiles on the level (AVX2: not
q8_0); the others keep the tiled float schedule, and so does every CPU without AVX2.

This changes prefill's numerics as llama.cpp's do: activations rounded to int8 per 32 with
a per-row step, the rule decode uses (`schedules.cpu.int8_ops`); the manifest records it
(`target.details.prefill_activations`). On CPUs with AMX (Sapphire Rapids and newer) the
kernels are `schedules.cpu.amx_prefill`'s: activations and decoded weights rounded to bf16,
float sums, for calls of 32 rows or more (`target.details.prefill_bf16_amx_from_rows`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .int8_decode_pass import ACTIVATIONS, substitute_kernels

if TYPE_CHECKING:
    from .backends.base import BuildReport

log = logging.getLogger(__name__)


def int8_prefill_kernels(report: BuildReport, vnni: bool = True, amx: bool = False):
    """The module pass; records what it replaced in `report`. `vnni`: the target has
    AVX-512 VNNI, else AVX2 (the column tiles); `amx`: it has AMX with bf16 products too
    (`schedules.cpu.amx_prefill`: bf16 activations and weights, int8 under 32 rows)."""
    import tvm

    from tallow.schedules.cpu.amx_prefill import MIN_ROWS
    from tallow.schedules.cpu.int8_prefill import prefill_kernel_for

    @tvm.transform.module_pass(opt_level=0, name="tallow.Int8PrefillKernels")
    def _pass(mod, _ctx):
        replaced = substitute_kernels(mod, lambda func: prefill_kernel_for(func, vnni, amx))
        report.prefill_activations = ACTIVATIONS if replaced else "float32"
        if replaced and amx:
            report.prefill_bf16_amx_from_rows = MIN_ROWS
        report.int8_prefill_kernels = replaced
        log.info("int8-activation prefill kernels: %d", replaced)
        return mod

    return _pass
