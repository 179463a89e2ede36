"""Decode matmuls over GGUF-block weights with a static row count (the `decode` function's
`[1, 1, K] x W^T`): a dequantize-fused matrix-vector schedule of our own.

dlight's `GEMV` rule inlines the `dequantize` block into the matmul and then fails its own
access analysis on the byte ranges a block decoder reads (an `AssertionError` in
`collect_block_iter_vars_used_in_access_region`, TVM 0.27); `LowBatchGEMV` handles the
symbolic-batch `batch_decode` kernels but declines static shapes. Without this rule those
kernels land on `Fallback` (one thread per output, each walking a whole weight row alone:
uncoalesced loads).

The schedule: a block of `ROWS_PER_BLOCK` warps; warp `ty` owns output column `n`; its 32
lanes split K into chunks of `VEC` consecutive weights. A lane decodes its chunk once into
registers (`dequantize` computed at the chunk loop) and multiplies it with every row of x, so
each weight byte is loaded from memory once per kernel whatever the row count; the lanes'
partial sums meet in a warp reduction (TVM lowers the thread-bound reduction to shuffles).
"""

from __future__ import annotations

from tvm import s_tir, tirx

LANES = 32  # threadIdx.x: one warp splits K
VEC = 8  # consecutive weights a lane decodes per step (K is a multiple of 256 in K-quants)
ROWS_PER_BLOCK = 4  # threadIdx.y: output columns per thread block
MAX_ROWS = 64  # decode batches this rule takes (the accumulators live in registers)


def _static(extent) -> int | None:
    return int(extent) if isinstance(extent, tirx.IntImm) else None


class QuantDecodeGEMV:
    """`apply(func, target, tunable)` like a dlight rule: a Schedule, or None if not ours."""

    def apply(self, func: tirx.PrimFunc, target, _tunable: bool = False):
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        try:
            deq = sch.get_sblock("dequantize")
            mm = sch.get_sblock("matmul")
        except Exception:  # noqa: BLE001 - not a quantized matmul
            return None
        loops = sch.get_loops(mm)
        if len(loops) < 3:
            return None
        *row_loops, n_loop, k_loop = loops
        extents = [_static(sch.get(lp).extent) for lp in loops]
        if any(e is None for e in extents):
            return None  # symbolic rows: dlight's LowBatchGEMV
        rows = 1
        for e in extents[:-2]:
            rows *= e
        n, k = extents[-2], extents[-1]
        if rows > MAX_ROWS or k % (LANES * VEC) or n % ROWS_PER_BLOCK:
            return None
        consumers = sch.get_consumers(mm)
        if len(consumers) > 1:
            return None
        epilogue = consumers[0] if consumers else None
        if epilogue is not None and not _fold_tail(sch, epilogue):
            return None

        r = sch.fuse(*row_loops) if row_loops else None
        n_o, n_i = sch.split(n_loop, [None, ROWS_PER_BLOCK])
        k_o, k_t, k_v = sch.split(k_loop, [None, LANES, VEC])
        order = [n_o, n_i, k_t, k_o, k_v] + ([r] if r is not None else [])
        sch.reorder(*order)
        rf = sch.rfactor(k_t, factor_axis=0)
        # rf: per-lane partial sums, registers; mm: the cross-lane (warp) reduction.
        sch.set_scope(rf, 0, "local")
        rf_loops = sch.get_loops(rf)  # n_o, n_i, k_t, k_o, k_v, [r]
        sch.bind(rf_loops[0], "blockIdx.x")
        sch.bind(rf_loops[1], "threadIdx.y")
        sch.bind(rf_loops[2], "threadIdx.x")
        sch.compute_at(deq, rf_loops[3])  # decode this lane's VEC weights once per step
        sch.set_scope(deq, 0, "local")
        sch.unroll(sch.get_loops(rf)[4])
        sch.decompose_reduction(rf, rf_loops[3])
        sch.reverse_compute_at(mm, rf_loops[1])
        # Under n_i: the k_t reduction, then the rows (more than one row only). The lanes must
        # be the innermost loop, bound to threadIdx.x: bound to the rows instead, each thread
        # would sum the other lanes' register partials (wrong, and spilled to the stack).
        lane, *rows = sch.get_loops(mm)[2:]
        if rows:
            sch.reorder(*rows, lane)
        sch.bind(lane, "threadIdx.x")  # the k_t reduction across the warp
        if epilogue is not None:
            sch.set_scope(mm, 0, "local")
            sch.reverse_compute_at(epilogue, rf_loops[1])
        return sch


def _fold_tail(sch, epilogue) -> bool:
    """Fold the blocks after `epilogue` into it (reverse-inlined), so the whole chain runs
    in the kernel: a decode projection's epilogue is the f16 cast, often followed by the
    residual add (`fused_quant_matmul_q4k6_add`) or the logits' f32 cast. Only `epilogue` is
    moved under the thread bindings below; a block left after it stayed a loop outside any
    kernel, which TVM's CUDA build turns into host code reading device memory (no error at
    compile time; found by the whole-model kernel replay, tests/test_kernel_replay.py).
    False (the rule declines) when a block cannot be folded."""
    while consumers := sch.get_consumers(epilogue):
        if len(consumers) > 1:
            return False
        try:
            sch.reverse_compute_inline(consumers[0])
        except Exception:  # noqa: BLE001 - TVM raises its own error type when it cannot
            return False
    return True
