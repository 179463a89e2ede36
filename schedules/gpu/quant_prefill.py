"""Prefill matmuls over GGUF blocks (dequantize, then a tensor-core GEMM), for the GPU.

On Metal, dlight's `MetalMatmul` with our f16 x f16 -> f32 simdgroup intrinsics
(`simdgroup_f32.py`). On CUDA as follows.

`QuantPrefillMatmul` takes only quantized matmuls (`rules.is_quant_matmul`) and starts from
dlight's `Matmul` rule, which on CUDA tensorizes them onto wmma: 512-thread blocks (16
warps, 2 x 2 accumulator fragments each, 128 x 128 tiles), the dequantize inlined into the
global -> shared copy of the weight tile. dlight pipelines that copy across the K loop
through registers (`software_pipeline_stage` on the outer K loop plus a local staging
buffer), so the next tile's raw bytes *and* their dequantized halves are live in registers
during the current tile's mma. With 512 threads ptxas may use at most 65536 / 512 = 128
registers per thread, and the dequantizing copy does not fit: measured with nvcc 13.0 on the
tiny Qwen3 (hidden 256, f16), the q6k prefill kernels with an epilogue spilled 12-16 bytes
(sm_80 and sm_90; 128 registers), and every other tensorized quantized kernel sat at exactly
the 128 cap, which larger shapes cross.

Without the outer K pipeline (the inner, shared -> fragment pipeline is kept), the same
kernels use 82-103 registers and spill nothing on sm_80 and sm_90. The cost: the weight
tile's global loads are no longer overlapped with the previous tile's mma inside a block;
16 warps per block still give the SM other warps to run while one waits. Not yet measured
on a GPU.
"""

from __future__ import annotations

from tvm import tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import get_root_block

from .simdgroup_f32 import f32_accumulators


def _all_blocks(sch) -> list:
    found = []

    def visit(parent):
        for child in sch.get_child_blocks(parent):
            found.append(child)
            visit(child)

    visit(get_root_block(sch))
    return found


def drop_outer_k_pipeline(sch) -> bool:
    """Remove the software-pipeline annotations of the outermost pipelined loop; True when
    there was one."""
    for block in _all_blocks(sch):
        for loop in sch.get_loops(block):
            if "software_pipeline_stage" in sch.get(loop).annotations:
                sch.unannotate(loop, "software_pipeline_stage")
                sch.unannotate(loop, "software_pipeline_order")
                return True
    return False


class QuantPrefillMatmul:
    """dlight's `Matmul` for quantized matmuls: on CUDA without the register-staged K
    pipeline (see the module docstring), on Metal with f32 simdgroup accumulators
    (`simdgroup_f32.py`). Other functions: None, left to the next rule."""

    def __init__(self):
        self._matmul = dl.gpu.Matmul()

    def apply(self, func: tirx.PrimFunc, target, tunable: bool):
        from .rules import is_quant_matmul

        if not isinstance(func, tirx.PrimFunc) or not is_quant_matmul(func):
            return None
        if target.kind.name == "metal":
            with f32_accumulators():  # simdgroup matrices: f16 operands, f32 accumulators
                return self._matmul.apply(func, target, tunable)
        sch = self._matmul.apply(func, target, tunable)
        if sch is None:
            return None
        if target.kind.name == "cuda":
            drop_outer_k_pipeline(sch)
        return sch
