"""The token sampler compiled into GPU artifacts (CUDA, Metal): one thread block per row.

The algorithm and its semantics are the CPU kernel's (`cpu/sampling.py`: bisection over
order-preserving int32 keys for top-k and top-p, a threshold for min-p, an inverse-CDF draw
in token order). Here each bisection step is one pass of the block's threads over the row
and a shared-memory tree reduction; every thread keeps the same copy of the row's scalars,
so the branches stay uniform and TVM's sync pass can place the barriers.

Thread t owns the contiguous tokens [t * L, (t + 1) * L) of its row (L = width / THREADS),
stored interleaved (its c-th token at slot c * THREADS + t) so that a pass's loads are
coalesced and no thread reads scratch another thread wrote. The draw: every thread walks
the segment sums (shared memory) to the segment holding `u * total`, whose owner walks its
tokens and writes the result.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..cpu.sampling import (
    CONTROLS,
    FLOAT_MIN,
    KEY_NEG_INF,
    KEY_PAD,
    STEPS,
    key,
    settle_segment,
    take_segment,
    walk_macro,
    workspace_width,
)
from ..tir_common import LOG2E, add, maximum, minimum

THREADS = 256  # threads per row; workspace_width is a multiple of it
LOG_THREADS = 8


def sample_kernel(vocab: int, padded: int):
    """Same signature and outputs as `cpu.sampling.sample_kernel`."""
    width = workspace_width(vocab)
    per_thread = width // THREADS  # strided elements per thread in a pass, and segment length
    # thread s owns tokens s * per_thread + j, stored interleaved at j * THREADS + s
    walk = walk_macro(per_thread, lambda s, j: j * THREADS + s, lambda s, j: s * per_thread + j)
    f32_min = tirx.const(FLOAT_MIN, "float32")

    def logit(x, r, i):
        return T.if_then_else(i < vocab, x[r, T.min(i, vocab - 1)], f32_min)

    @T.macro
    def tree_reduce(red, tx, value, combine):
        """red[0] <- combine over the block of every thread's `value` (barriers: TVM's, but
        the first). Every thread reads the previous result, red[0], right after the previous
        reduction: without a barrier here thread 0 could overwrite it first. TVM's sync pass
        misses that hazard when the previous reduction sits in a branch skipped for this row
        (top-k off, then top-p's first mass): Oclgrind reported the race, and with it a
        row's top-p threshold came out wrong."""
        T.evaluate(T.tvm_storage_sync("shared"))
        red[tx] = value
        for i in T.unroll(LOG_THREADS):
            if tx % (2 << i) == 0:
                red[tx] = combine(red[tx], red[tx + (1 << i)])

    @T.macro
    def mass_from(keys, weights, r, tx, red_f, f, at_least):
        """f[7] <- the row's mass of weights with key >= at_least; f[6] <- this thread's part."""
        f[6] = T.float32(0)
        for c in T.serial(per_thread):
            f[6] += T.if_then_else(
                keys[r, c * THREADS + tx] >= T.Cast("int32", at_least),
                weights[r, c * THREADS + tx],
                T.float32(0),
            )
        tree_reduce(red_f, tx, f[6], add)
        f[7] = red_f[0]

    @T.prim_func(s_tir=True)
    def sample(
        logits_h: T.handle,
        controls_h: T.handle,
        token_h: T.handle,
        weights_h: T.handle,
        keys_h: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int64()
        x = T.match_buffer(logits_h, (n, padded), "float32")
        controls = T.match_buffer(controls_h, (n, CONTROLS), "float32")
        token = T.match_buffer(token_h, (n,), "int32")
        weights = T.match_buffer(weights_h, (n, width), "float32")
        keys = T.match_buffer(keys_h, (n, width), "int32")
        # per-thread copies of the row's scalars (the same values in every thread)
        f = T.sblock_alloc_buffer((8,), "float32", scope="local")
        k = T.sblock_alloc_buffer((8,), "int64", scope="local")
        red_f = T.sblock_alloc_buffer((THREADS,), "float32", scope="shared")
        red_i = T.sblock_alloc_buffer((THREADS,), "int32", scope="shared")

        for r in T.thread_binding(n, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                f[6] = f32_min
                for c in T.serial(per_thread):
                    f[6] = T.max(f[6], logit(x, r, c * THREADS + tx))
                tree_reduce(red_f, tx, f[6], maximum)
                f[0] = red_f[0]  # max logit
                if T.tvm_thread_invariant(controls[r, 0] <= T.float32(0) or f[0] <= f32_min):
                    k[6] = T.int64(vocab)
                    for c in T.serial(per_thread):
                        if (
                            c * THREADS + tx < vocab
                            and x[r, T.min(c * THREADS + tx, vocab - 1)] == f[0]
                        ):
                            k[6] = T.min(k[6], T.Cast("int64", c * THREADS + tx))
                    tree_reduce(red_i, tx, T.Cast("int32", k[6]), minimum)
                    if tx == 0:
                        token[r] = T.min(red_i[0], vocab - 1)
                else:
                    f[1] = f[0] / controls[r, 0]
                    # thread tx owns tokens [tx * per_thread, (tx + 1) * per_thread), its
                    # c-th at slot c * THREADS + tx: reads stay coalesced, and no thread
                    # ever reads the scratch another wrote (no global-memory barrier needed)
                    for c in T.serial(per_thread):
                        weights[r, c * THREADS + tx] = T.if_then_else(
                            tx * per_thread + c < vocab,
                            T.exp2(
                                (logit(x, r, tx * per_thread + c) / controls[r, 0] - f[1])
                                * T.float32(LOG2E)
                            ),
                            T.float32(0),
                        )
                        keys[r, c * THREADS + tx] = T.if_then_else(
                            tx * per_thread + c < vocab,
                            key(logit(x, r, tx * per_thread + c) / controls[r, 0]),
                            KEY_PAD,
                        )
                    k[3] = T.int64(KEY_NEG_INF)
                    if T.tvm_thread_invariant(
                        controls[r, 1] > T.float32(0) and controls[r, 1] < T.float32(vocab)
                    ):
                        k[0] = T.int64(KEY_NEG_INF)
                        k[1] = T.Cast("int64", key(f[1])) + 1
                        for _step in T.serial(STEPS):
                            if T.tvm_thread_invariant(k[1] - k[0] > 1):
                                k[2] = (k[0] + k[1]) >> 1
                                k[6] = T.int64(0)
                                for c in T.serial(per_thread):
                                    if keys[r, c * THREADS + tx] >= T.Cast("int32", k[2]):
                                        k[6] += 1
                                tree_reduce(red_i, tx, T.Cast("int32", k[6]), add)
                                k[7] = T.Cast("int64", red_i[0])
                                if k[7] >= T.Cast("int64", controls[r, 1]):
                                    k[0] = k[2]
                                else:
                                    k[1] = k[2]
                        k[3] = k[0]
                    if T.tvm_thread_invariant(controls[r, 2] < T.float32(1)):
                        mass_from(keys, weights, r, tx, red_f, f, k[3])
                        f[2] = f[7] * controls[r, 2]
                        k[0] = k[3]
                        k[1] = T.Cast("int64", key(f[1])) + 1
                        for _step in T.serial(STEPS):
                            if T.tvm_thread_invariant(k[1] - k[0] > 1):
                                k[2] = (k[0] + k[1]) >> 1
                                mass_from(keys, weights, r, tx, red_f, f, k[2])
                                if f[7] >= f[2]:
                                    k[0] = k[2]
                                else:
                                    k[1] = k[2]
                        k[3] = k[0]
                    if controls[r, 3] > T.float32(0):
                        k[3] = T.max(k[3], T.Cast("int64", key(f[1] + T.log(controls[r, 3]))))

                    # each thread's tokens, in token order, summed into red_f
                    mass_from(keys, weights, r, tx, red_f, f, k[3])
                    f[3] = f[7] * controls[r, 4]  # target
                    red_f[tx] = f[6]  # the segment sums, for every thread to walk
                    f[4] = T.float32(0)
                    k[4] = T.int64(-1)
                    k[5] = T.int64(0)
                    for s in T.serial(THREADS):
                        f[5] = red_f[s]  # a shared load may not sit in a condition
                        if k[4] < 0:
                            take_segment(f, k, s)
                    settle_segment(f, k)
                    if T.Cast("int64", tx) == k[4]:  # the owner walks its segment, writes the token
                        walk(keys, weights, r, f, k, token)

    return sample
