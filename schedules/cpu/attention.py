"""CPU attention kernels for TVM's paged KV cache, in place of its reference ones.

`TIRPagedKVCache` builds its CPU (llvm) attention kernels as single-threaded scalar loops,
and its paged prefill walks the whole cache capacity for every query row. Measured on
SmolLM2-135M (2 cores): attention was 2.9 s of a 7.2 s prefill of 500 tokens and 19 ms of
a 62 ms decode step at 500 tokens of context. The kernels here keep the same signatures and
the same results (output, and the log2-sum-exp `lse` that the cache uses to merge partial
attentions). Decode's kernel is in `cpu.attention_decode`; the prefill kernels here are

* parallel over (block of query heads, query row), the rows in zigzag order (0, n-1, 1,
  n-2, ...) so that the thread pool's contiguous shares of the tasks carry equal work;
* a block is up to 4 query heads of one KV head (GQA), attended together: each key and
  value vector loaded serves all of them, and the dot products keep 4 FMA chains in all.
  One head at a time, with one chain per key row, every FMA waited on two loads or on the
  last FMA. Llama 3.2 3B's shape (24 heads, 8 KV heads, head_dim 128), 500 tokens, causal,
  one thread, CPU time, x86-64-v3 build on an Intel Xeon: 51.7 -> 36.3 ms a layer;
  SmolLM2's (9 and 3, 64) at 2,000 tokens 192 -> 128 ms; Llama 3.1 8B's (32 and 8) with the
  AVX-512 build 80.4 -> 49.6 ms;
* 16-lane slices of head_dim where the target has AVX-512 (`vector_lanes`, as decode), 8
  elsewhere: AVX-512 build, one thread, the 3B shape 35.0 -> 27.5 ms, SmolLM2's at 2,000
  tokens 124.7 -> 100.4, the 8B shape 47.4 -> 36.3;
* vectorised over head_dim: 8- or 16-lane partial dot products, vector rescale and accumulate;
* one pass over the rows with an online softmax, 8 rows (`TILE`) at a time: their scores,
  one max, at most one rescale, and one vector exp2 (a polynomial, `tir_common.exp2`: libm's exp2f
  is a scalar call per row and was a third of the time);
* bounded by the sequence's own length, not the cache's capacity.

Scores are in the log2 domain (q.k * sm_scale * log2(e)), as in TVM's kernels, so `lse`
means the same to the merge kernel. They never apply RoPE (`rotary_mode` is ignored): the
cache applies it before appending (`RopeMode.NORMAL`), or the graph does (Gemma 3).

Two model facts arrive as attributes on the kernels the cache built (model_defs/parts.py):
a sliding window (a query at position p sees keys at positions p - window + 1 .. p, as
transformers masks them; a layer asks for it by passing its scale negated, since one
kernel serves every layer) and an attention-score soft cap (Gemma 2: scores become
cap * tanh(scores / cap)). A windowed query starts at its window's first key row, so a
windowed layer reads at most `window` rows whatever the context.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from tallow.model_defs.parts import SOFTCAP_ATTR, WINDOW_ATTR

from ..tir_common import LOG2E, add, exp2, reduce_lanes
from .attention_decode import (
    LANES,
    NEG,
    TILE,
    capped,
    decode_kernel,
    raise_max_macro,
    vector_lanes,
    window_start,
)

MAX_HEADS = 4  # query heads of one KV head attended together (see `_attend`)


def heads_per_block(group: int) -> int:
    """Query heads `_attend` takes at once: the largest divisor of the GQA group (query heads
    per KV head) up to `MAX_HEADS`."""
    return max(h for h in range(1, MAX_HEADS + 1) if group % h == 0)


def chains_for(heads: int) -> int:
    """Independent FMA chains per head and key row in the dot products: a row's 16-32
    FMAs in one chain wait on each other's latency; 4 chains in all keep the unit busy
    without spilling the accumulators."""
    return max(1, 4 // heads)


def _attend(
    paged: bool, d: int, page_size: int, dtype: str, heads: int, cap=None, lanes: int = LANES
):
    """The online-softmax loop of one query row for query heads `h0..h0+heads-1`, which share
    key/value head `hk`, over key rows `lo`..`n`, prefill.

    The heads go together so that each key and value vector loaded serves all of them (GQA
    models have 2-8 query heads per KV head): one head at a time, each FMA had two loads
    (the query or the output accumulator, and the key or value) and the loads bound it.
    Paged: row j lives in page `values[base + j // page_size]`, slot `j % page_size` of
    `kv` ([pages, 2, h_kv, page_size, d]); ragged: `k[base + j]`, `v[base + j]`.
    State per head: st[4j] running max, st[4j+1] running sum, st[4j+2] the tile's max,
    st[4j+3] the rescale; `o_acc` the unnormalised outputs.
    """
    nd = d // lanes
    qscale = 1.0 if cap is not None else LOG2E
    chains = chains_for(heads)
    raise_max = raise_max_macro(d)

    def cached(kv, which: int, values, base, hk, row, col):
        """Element `col` of key (which=0) or value (1) row `row`, as float32."""
        if paged:
            page = values[base + row // page_size]
            return kv[page, which, hk, row % page_size, col].astype("float32")
        return kv[base + row, hk, col].astype("float32")

    def dot(acc, j: int, r):
        """Head `j`'s dot product with key row `r` of the tile: its chains added, then lanes."""
        total = None
        for c in range(chains):
            part = acc[tvm.tirx.Ramp(((j * TILE + r) * chains + c) * lanes, 1, lanes)]
            total = part if total is None else total + part
        return reduce_lanes(total, lanes, add)

    @T.macro
    def attend(q, qi, h0, sm_scale, lo, n, k, v, values, base, hk, output, lse):
        o_acc, qv, acc, sc, st = _state(d, heads, chains, lanes)
        for j in T.unroll(heads):
            st[j * 4] = T.float32(NEG)
            st[j * 4 + 1] = T.float32(1.0)
            for i in T.vectorized(d):
                o_acc[j * d + i] = T.float32(0)
                # log2(e) folds into q, or (soft cap) applies after the cap
                qv[j * d + i] = (
                    T.Cast("float32", q[qi, h0 + j, i]) * T.abs(sm_scale) * T.float32(qscale)
                )
        for t in T.serial((n - lo + TILE - 1) // TILE):
            r0: T.let[T.int32] = lo + t * TILE  # the tile's first key row
            for a in T.unroll(heads * TILE * chains):
                for ln in T.vectorized(lanes):
                    acc[a * lanes + ln] = T.float32(0)
            for r in T.serial(TILE):  # unrolled, LLVM hoisted all 64 loads and spilled them
                for c in T.unroll(nd):
                    for j in T.unroll(heads):
                        for ln in T.vectorized(lanes):
                            acc[((j * TILE + r) * chains + c % chains) * lanes + ln] += qv[
                                j * d + c * lanes + ln
                            ] * cached(k, 0, values, base, hk, T.min(r0 + r, n - 1), c * lanes + ln)
            for j in T.unroll(heads):
                for r in T.unroll(TILE):
                    sc[j * TILE + r] = T.Select(
                        r0 + r < n, capped(dot(acc, j, r), cap), T.float32(NEG)
                    )
                st[j * 4 + 2] = sc[j * TILE]
                for r in T.serial(1, TILE):
                    st[j * 4 + 2] = T.max(st[j * 4 + 2], sc[j * TILE + r])
                raise_max(st, o_acc, j)
                for r in T.vectorized(TILE):
                    # masked rows weigh exactly 0 (exp2 bottoms out at 2**-126)
                    sc[j * TILE + r] = T.Select(
                        r0 + r < n, exp2(sc[j * TILE + r] - st[j * 4]), T.float32(0)
                    )
                for r in T.serial(TILE):
                    st[j * 4 + 1] += sc[j * TILE + r]
            # each 8-lane slice of the outputs takes the tile's rows while in a register
            for c in T.unroll(nd):
                for r in T.unroll(TILE):
                    for j in T.unroll(heads):
                        for ln in T.vectorized(lanes):
                            o_acc[j * d + c * lanes + ln] += sc[j * TILE + r] * cached(
                                v, 1, values, base, hk, T.min(r0 + r, n - 1), c * lanes + ln
                            )
        for j in T.unroll(heads):
            for i in T.vectorized(d):
                output[qi, h0 + j, i] = T.Cast(dtype, o_acc[j * d + i] / st[j * 4 + 1])
            lse[qi, h0 + j] = st[j * 4] + T.log2(st[j * 4 + 1])

    return attend


def zigzag(i, n):
    """Row of the `i`-th task among `n` rows: 0, n-1, 1, n-2, ... Causal rows cost more the
    later they are; in this order any run of consecutive tasks mixes cheap and dear rows
    evenly, so the thread pool's contiguous shares of (head block, row) tasks weigh alike
    even when there are few head blocks (SmolLM2: 3)."""
    return T.if_then_else(i % 2 == 0, i // 2, n - 1 - i // 2)


@T.macro
def _owner(seq, q_indptr, batch_size, row):
    """seq[0] = the sequence whose query rows include `row`."""
    seq[0] = 0
    for s in T.serial(batch_size):
        if q_indptr[s + 1] <= row:
            seq[0] = s + 1


# The cache's CPU kernels, by their names in the module (TVM 0.27, non-sliding-window).
DECODE = "batch_decode_paged_kv_cpu"
PREFILL_RAGGED = "batch_prefill_ragged_kv"
PREFILL_PAGED = "batch_prefill_paged_kv_cpu"


def _state(d: int, heads: int, chains: int, lanes: int):
    """Scratch per query row, for each of `heads` heads: output accumulator, scaled query,
    the tile's partial dot products, its scores, and 4 softmax state values (running max and
    sum, tile max, rescale factor)."""
    return (
        T.sblock_alloc_buffer((heads * d,), "float32"),
        T.sblock_alloc_buffer((heads * d,), "float32"),
        T.sblock_alloc_buffer((heads * TILE * chains * lanes,), "float32"),
        T.sblock_alloc_buffer((heads * TILE,), "float32"),
        T.sblock_alloc_buffer((heads * 4,), "float32"),
    )


def _prefill_ragged(
    h_kv: int, h_q: int, d: int, dtype: str, window=None, cap=None, lanes: int = LANES
):
    group = h_q // h_kv
    heads = heads_per_block(group)
    attend = _attend(False, d, 1, dtype, heads, cap, lanes)

    @T.prim_func(s_tir=True)
    def prefill_ragged(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_kv_indptr: T.handle,
        var_q_rope_position: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=T.int32())
        k = T.match_buffer(var_k, (kv_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=T.int32())
        # positions: the first new key's of each sequence, each query row's (windows)
        k_offset = T.match_buffer(
            var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=T.int32()
        )
        q_pos = T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=T.int32())
        output = T.match_buffer(var_output, (qo_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")

        for hr in T.parallel(h_q // heads * qo_len):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                seq = T.sblock_alloc_buffer((1,), "int32")
                h: T.let[T.int32] = hr // qo_len * heads
                row: T.let[T.int32] = zigzag(hr % qo_len, qo_len)
                _owner(seq, q_indptr, batch_size, row)
                b: T.let[T.int32] = seq[0]
                n_kv: T.let[T.int32] = kv_indptr[b + 1] - kv_indptr[b]
                n_q: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                n: T.let[T.int32] = T.if_then_else(
                    causal > 0, T.min(n_kv, n_kv - n_q + (row - q_indptr[b]) + 1), n_kv
                )
                lo: T.let[T.int32] = window_start(window, sm_scale, q_pos[row], k_offset[b])
                attend(
                    q, row, h, sm_scale, lo, n, k, v, kv_indptr, kv_indptr[b], h // group,
                    output, lse,
                )  # fmt: skip

    return prefill_ragged


def _prefill_paged(
    h_kv: int, h_q: int, d: int, dtype: str, page_size: int, window=None, cap=None, lanes=LANES
):
    group = h_q // h_kv
    heads = heads_per_block(group)
    attend = _attend(True, d, page_size, dtype, heads, cap, lanes)

    @T.prim_func(s_tir=True)
    def prefill_paged(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_values: T.handle,
        var_length_info: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=T.int32())
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype)
        indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=T.int32())
        values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=T.int32())
        last_page_len = T.match_buffer(
            var_length_info, (batch_size,), "int32", elem_offset=T.int32()
        )
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        k_offset = T.match_buffer(
            var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=T.int32()
        )
        q_pos = T.match_buffer(var_q_rope_position, (total_len,), "int32", elem_offset=T.int32())

        for hr in T.parallel(h_q // heads * total_len):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                seq = T.sblock_alloc_buffer((1,), "int32")
                h: T.let[T.int32] = hr // total_len * heads
                row: T.let[T.int32] = zigzag(hr % total_len, total_len)
                _owner(seq, q_indptr, batch_size, row)
                b: T.let[T.int32] = seq[0]
                n_pages: T.let[T.int32] = indptr[b + 1] - indptr[b]
                n_kv: T.let[T.int32] = T.if_then_else(
                    n_pages > 0, (n_pages - 1) * page_size + last_page_len[b], 0
                )
                n_q: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                n: T.let[T.int32] = T.max(
                    0,
                    T.if_then_else(
                        causal > 0, T.min(n_kv, n_kv - n_q + (row - q_indptr[b]) + 1), n_kv
                    ),
                )
                lo: T.let[T.int32] = window_start(window, sm_scale, q_pos[row], k_offset[b])
                attend(
                    q, row, h, sm_scale, lo, n, pages, pages, values, indptr[b], h // group,
                    output, lse,
                )  # fmt: skip

    return prefill_paged


def _shape(func, index: int) -> tuple[list, str]:
    buf = func.params[index]  # TVM 0.27 PrimFunc parameters carry their buffer's shape
    return [int(x) if isinstance(x, tvm.tirx.IntImm) else None for x in buf.shape], str(buf.dtype)


def _replacement(name: str, func, target):
    """Our kernel for the cache kernel `name`, sized from its buffers; None if not ours."""
    attrs = func.attrs or {}
    window = int(attrs[WINDOW_ATTR]) if WINDOW_ATTR in attrs else None
    cap = float(attrs[SOFTCAP_ATTR]) if SOFTCAP_ATTR in attrs else None
    ours = None
    if name == DECODE:
        (_, h_q, d), dtype = _shape(func, 0)
        (_, _, h_kv, page_size, _), _ = _shape(func, 1)
        if d % LANES == 0:
            lanes = vector_lanes(target, d)
            ours = decode_kernel(h_kv, h_q, d, dtype, page_size, lanes, window, cap)
    elif name == PREFILL_RAGGED:
        (_, h_q, d), dtype = _shape(func, 0)
        (_, h_kv, d_v), _ = _shape(func, 3)
        if d == d_v and d % LANES == 0:
            lanes = vector_lanes(target, d)
            ours = _prefill_ragged(h_kv, h_q, d, dtype, window, cap, lanes)
    elif name == PREFILL_PAGED:
        (_, h_q, d), dtype = _shape(func, 0)
        (_, _, h_kv, page_size, _), _ = _shape(func, 2)
        if d % LANES == 0:
            lanes = vector_lanes(target, d)
            ours = _prefill_paged(h_kv, h_q, d, dtype, page_size, window, cap, lanes)
    else:
        return None
    if ours is None and (window is not None or cap is not None):
        # TVM's own kernel would silently attend to everything, uncapped
        raise ValueError(
            f"attention kernel {name}: a sliding window or soft cap needs tallow's CPU "
            f"kernels, which need head_dim a multiple of {LANES}"
        )
    return ours


def replace_attention_kernels(mod: tvm.IRModule, target) -> tvm.IRModule:
    """Swap the KV cache's CPU attention kernels in `mod` for the ones above (with 16-lane
    vectors where `target` has AVX-512)."""
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        ours = _replacement(gv.name_hint, func, target)
        if ours is not None:
            symbol = func.attrs.get("global_symbol") if func.attrs else None
            mod[gv] = ours.with_attr("global_symbol", symbol) if symbol else ours
    return mod
