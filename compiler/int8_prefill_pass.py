"""Give the prefill functions' quantized matmuls int8-activation kernels (AVX-512 VNNI CPUs).

`prefill` and `batch_prefill` multiply `[1, tokens, K]` (a symbolic token count) by every
quantized weight. Float activations and the tiled dequantize-matmul (`schedules.cpu.tiled`)
reach about 8 multiply-adds per instruction; `schedules.cpu.int8_prefill`'s kernel, the
batched-decode VNNI tiles over the token rows, about 64 per `vpdpbusd`. Like
`int8_decode_pass`, this substitutes the kernel (same parameters: x, w, out) before fusion,
marked opaque, for the kernels whose format has int8 groups; the others keep the tiled float
schedule, and so does every CPU without AVX-512 VNNI (AVX2: the float tiles).

This changes prefill's numerics as llama.cpp's do: activations rounded to int8 per 32 with
a per-row step, the rule decode uses (`schedules.cpu.int8_ops`); the manifest records it
(`target.details.prefill_activations`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .int8_decode_pass import ACTIVATIONS, substitute_kernels

if TYPE_CHECKING:
    from .backends.base import BuildReport

log = logging.getLogger(__name__)


def int8_prefill_kernels(report: BuildReport):
    """The module pass; records what it replaced in `report`."""
    import tvm

    from tallow.schedules.cpu.int8_prefill import prefill_kernel_for

    @tvm.transform.module_pass(opt_level=0, name="tallow.Int8PrefillKernels")
    def _pass(mod, _ctx):
        replaced = substitute_kernels(mod, prefill_kernel_for)
        report.prefill_activations = ACTIVATIONS if replaced else "float32"
        report.int8_prefill_kernels = replaced
        log.info("int8-activation prefill kernels: %d", replaced)
        return mod

    return _pass
