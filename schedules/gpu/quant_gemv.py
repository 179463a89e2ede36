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
X_VECTOR_LANES = 4  # f16 activations per vector load (`vector_x`)


def _static(extent) -> int | None:
    return int(extent) if isinstance(extent, tirx.IntImm) else None


class QuantDecodeGEMV:
    """`apply(func, target, tunable)` like a dlight rule: a Schedule, or None if not ours.

    `unroll`: K blocks (of LANES * VEC weights) each lane works through per loop iteration,
    unrolled, so the loads of several blocks are in flight together instead of one block's
    loads completing before the next are issued (None: 16 // rows, at most 4, so the row
    accumulators and the unrolled blocks share the registers). `vector_x`: each lane loads its
    VEC activations of a row as vectors of X_VECTOR_LANES halves instead of VEC 2-byte loads.
    From the SASS (nvcc 13.0, sm_90, a 4096 x 4096 q4k projection): loads per lane and K block
    24 -> 18 at one row, 144 -> 48 at 16 rows, 528 -> 144 at 64; registers 32 -> 40, 47 -> 55
    and 96 -> 128; no spills."""

    def __init__(self, unroll: int | None = 1, vector_x: bool = False):
        self.unroll = unroll
        self.vector_x = vector_x

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

        blocks = k // (LANES * VEC)
        # CUDA only: written after an H100 ran the one-block, 2-byte-load form at 14% of the
        # memory bound (docs/gpu-artifacts.md#the-gpu-check); not yet timed on a GPU. Metal and
        # WebGPU keep that form until a device of theirs runs either.
        cuda = target.kind.name == "cuda"
        unroll = (self.unroll or max(1, min(4, 16 // rows))) if cuda else 1
        unroll = next(u for u in range(unroll, 0, -1) if blocks % u == 0)
        r = sch.fuse(*row_loops) if row_loops else None
        n_o, n_i = sch.split(n_loop, [None, ROWS_PER_BLOCK])
        k_o, k_u, k_t, k_v = sch.split(k_loop, [None, unroll, LANES, VEC])
        # The rows outside the VEC weights: a lane decodes its weights once (at k_u), then
        # each row takes its VEC activations (one vector load) and VEC products.
        order = [n_o, n_i, k_t, k_o, k_u] + ([r] if r is not None else []) + [k_v]
        sch.reorder(*order)
        rf = sch.rfactor(k_t, factor_axis=0)
        # rf: per-lane partial sums, registers; mm: the cross-lane (warp) reduction.
        sch.set_scope(rf, 0, "local")
        rf_loops = sch.get_loops(rf)  # n_o, n_i, k_t, k_o, k_u, [r], k_v
        sch.bind(rf_loops[0], "blockIdx.x")
        sch.bind(rf_loops[1], "threadIdx.y")
        sch.bind(rf_loops[2], "threadIdx.x")
        sch.compute_at(deq, rf_loops[4])  # decode this lane's VEC weights once per block
        sch.set_scope(deq, 0, "local")
        if self.vector_x and cuda:
            _vector_x(sch, rf, rf_loops[-2])
        for loop in rf_loops[5:]:  # the rows and the VEC weights: registers, not local arrays
            sch.unroll(loop)
        sch.decompose_reduction(rf, rf_loops[3])
        if unroll > 1:
            sch.unroll(rf_loops[4])
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


def _vector_x(sch, rf, loop) -> None:
    """Stage each lane's activations (every row, VEC consecutive values) in registers at
    `loop`, loaded as vectors."""
    reads = [region.source for region in sch.get(rf).reads]
    index = next(i for i, b in enumerate(reads) if b.scope() == "global")
    cache = sch.cache_read(rf, index, "local")
    sch.compute_at(cache, loop)
    # 4-lane vectors (8 bytes): WebGPU's and Metal's longest, so the kernel replay
    # (tests/test_kernel_replay.py) runs the CUDA schedule as it is; CUDA emits two loads.
    vectors, lanes = sch.split(sch.get_loops(cache)[-1], [None, X_VECTOR_LANES])
    sch.vectorize(lanes)
    sch.unroll(vectors)  # constant offsets: the array stays in registers


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
