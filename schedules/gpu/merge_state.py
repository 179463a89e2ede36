"""The paged KV cache's merge of two attention states, without the race of TVM's kernel.

A prefill after cached tokens attends twice (to the chunk's own tokens, ragged, and to the
cached pages) and merges the two partial results in place: V <- (V 2^S + V' 2^S') / (2^S +
2^S'), S <- log2(2^S + 2^S'). TVM 0.27's `merge_state_inplace`, which `TIRPagedKVCache`
compiles into every GPU artifact as `tir_attention_merge_state`, has each of a head's
work-items read S[n, h] and then write it, with no barrier between. Oclgrind reports 360
read-write and 180 write-write races at 4 heads of 64, and PoCL, which runs one work-item
after another, gets a wrong V (`tests/opencl_paged_kv.py`). On a GPU a head whose work-items
share one converged warp loads before it stores, but nothing promises that, and a head of
256 dims (Gemma) spreads over two warps of TVM's 64 work-items.

Here lane 0 of a head alone reads and writes S in global memory: it puts S and S_other in
shared memory, and the head's other lanes read them there after a barrier. A head's 32
lanes stride over its dims (coalesced, any D) and each block takes `HEADS_PER_BLOCK` heads,
so the kernel needs neither the head count nor the head size at compile time.
"""

from __future__ import annotations

from tvm.script import tirx as T

LANES = 32  # work-items per head: one warp on CUDA, one simdgroup on Apple GPUs
HEADS_PER_BLOCK = 4
# the names TIRPagedKVCache gives its merge kernels (the second for MLA's other v dims)
MERGE_FUNCTIONS = ("tir_attention_merge_state", "tir_attention_merge_state_mla")


def merge_state_kernel(v_dtype: str):
    """merge(V [N, H, D] v_dtype, S [N, H] f32, V_other, S_other): TVM's signature and
    semantics (S in log2), weights and sums in float32; the buffers and sizes keep TVM's
    names (V, S, V_other, S_other; N, H, D), which its callers may bind by."""

    @T.prim_func(s_tir=True)
    def merge(v_h: T.handle, s_h: T.handle, v_other_h: T.handle, s_other_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        N = T.int32()
        H = T.int32()
        D = T.int32()
        V = T.match_buffer(v_h, (N, H, D), v_dtype)
        S = T.match_buffer(s_h, (N, H), "float32")
        V_other = T.match_buffer(v_other_h, (N, H, D), v_dtype)
        S_other = T.match_buffer(s_other_h, (N, H), "float32")
        # w[0], w[1]: the two states' weights; w[2]: the larger S; w[3]: the weights' sum
        w = T.sblock_alloc_buffer((4,), "float32", scope="local")
        # lane 0's copy of its head's S and S_other, for the other lanes
        shared_s = T.sblock_alloc_buffer((HEADS_PER_BLOCK, 2), "float32", scope="shared")

        for row in T.thread_binding(N, thread="blockIdx.x"):
            for hb in T.thread_binding(
                (H + HEADS_PER_BLOCK - 1) // HEADS_PER_BLOCK, thread="blockIdx.y"
            ):
                for ty in T.thread_binding(HEADS_PER_BLOCK, thread="threadIdx.y"):
                    for tx in T.thread_binding(LANES, thread="threadIdx.x"):
                        if tx == 0 and hb * HEADS_PER_BLOCK + ty < H:
                            shared_s[ty, 0] = S[row, hb * HEADS_PER_BLOCK + ty]
                            shared_s[ty, 1] = S_other[row, hb * HEADS_PER_BLOCK + ty]
                        T.evaluate(T.tvm_storage_sync("shared"))
                        if hb * HEADS_PER_BLOCK + ty < H:
                            w[2] = T.max(shared_s[ty, 0], shared_s[ty, 1])
                            w[0] = T.exp2(shared_s[ty, 0] - w[2])
                            w[1] = T.exp2(shared_s[ty, 1] - w[2])
                            w[3] = w[0] + w[1]
                            for i in T.serial((D + LANES - 1) // LANES):
                                if i * LANES + tx < D:
                                    V[row, hb * HEADS_PER_BLOCK + ty, i * LANES + tx] = T.Cast(
                                        v_dtype,
                                        (
                                            T.Cast(
                                                "float32",
                                                V[row, hb * HEADS_PER_BLOCK + ty, i * LANES + tx],
                                            )
                                            * w[0]
                                            + T.Cast(
                                                "float32",
                                                V_other[
                                                    row, hb * HEADS_PER_BLOCK + ty, i * LANES + tx
                                                ],
                                            )
                                            * w[1]
                                        )
                                        / w[3],
                                    )
                            if tx == 0:  # the one work-item that read S writes it
                                S[row, hb * HEADS_PER_BLOCK + ty] = T.log2(w[3]) + w[2]

    return merge


def replace_merge_state(mod) -> list[str]:
    """Put tallow's merge kernel in place of each of TVM's in `mod` (same name, symbol and
    buffers' dtype); the names replaced, none for a module without one."""
    names = {gv.name_hint: gv for gv in mod.get_global_vars()}
    replaced = []
    for name in MERGE_FUNCTIONS:
        gv = names.get(name)
        if gv is None:
            continue
        old = mod[gv]
        v_dtype = str(old.params[0].dtype)  # TVM 0.27: parameters carry their buffer
        mod[gv] = merge_state_kernel(v_dtype).with_attr("global_symbol", name)
        replaced.append(name)
    return replaced
