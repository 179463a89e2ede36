"""Prefill attention on the CPU for TVM's paged KV cache: blocks of query rows, as a GEMM.

The row kernel (`attention_rows`, the only one until 2026-12-07) takes one query row at a
time (with the heads of its KV head): each score a dot product over head_dim, summed across
a vector's lanes at the end, the softmax on scalars per key row. At long prompts that was
the whole prefill: a 16,000-token prompt of the Qwen2.5-0.5B shape spent ~400 of its 424 s
there, about 30 GFLOP/s on 2 cores (6% of the FMA peak), and llama.cpp, whose CPU path
multiplies Q by K as a matrix product, prefilled it twice as fast.

A sequence with `few_rows` new rows or more goes through the blocks here; one with fewer
(a speculative verification, a prompt's last rows) through the row kernel, whose cost is
per row: a block's fixed cost (the transposes, its state) made a 2-row forward of SmolLM2
(one thread, 64 tokens of context) 7.0 -> 8.0 ms. Which kernel a row takes depends only on
its own sequence's row count, which deterministic mode fixes (prompts cut on a chunk grid).

Here a task is one query head and a block of `lanes` consecutive query rows (8 on AVX2, 16
on AVX-512), and each vector holds those rows:

* the block's queries are stored transposed once (`qt[c, row]`), so a key row's score for
  all rows is `sum_c k[c] * qt[c, :]`: one FMA per element of head_dim with `k[c]`
  broadcast, no sum across lanes; `TILE` key rows at a time, their scores in 8 registers;
* the online softmax runs on the rows' vectors: one max, one rescale and one `exp2`
  (`tir_common.exp2`, a polynomial) per key row for all the block's rows;
* the outputs are kept transposed too (`ot[c, row]`): each value row adds `p * v[c]` to
  them, an FMA per element; they are written back row by row at the end;
* the tile's key and value rows are copied to float32 first (`kt`, `vt`: the paged cache's
  page lookups, and an f16 cache's converts, once per row, not per block row).

Each row sees the keys its own sequence gives it (causal: up to its position; a sliding
window: from its window's start), a lane mask per key row; a block whose rows span several
sequences (a batched prefill) runs one pass per sequence with the other lanes masked, and a
block with no row of a long sequence does nothing. Key tiles start at multiples of `TILE`
whatever the block, and a masked key row changes nothing (its weight is exactly 0, its max
does not count), so a row's result does not depend on the rows it shares a block with: the
same bits in any chunking of the prompt into chunks of `few_rows` rows or more.
Rows in zigzag order over the blocks (0, n-1, 1, ...): causal blocks cost more the later
they are, and the thread pool's contiguous shares of the tasks then weigh alike.

Scores are in the log2 domain (q.k * sm_scale * log2(e)) and `lse` is log2-sum-exp, as in
TVM's kernels (the cache merges partial attentions with it). RoPE is never applied here (the
cache applies it before appending, or the graph does). A layer with a sliding window passes
its scale negated (model_defs/parts.py); a soft cap (Gemma 2) applies `cap * tanh(s / cap)`.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..tir_common import LOG2E, exp2
from .attention_decode import NEG, capped, window_start
from .attention_rows import every_row, kv_length, owner, zigzag

TILE = 8  # key rows scored together: their scores stay in registers while head_dim runs


def few_rows(lanes: int) -> int:
    """A sequence with fewer new rows than this takes the row kernel. A block costs what its
    `lanes` rows do whatever how many are used; the row kernel costs per row. One sequence
    of m new rows over 64-2,048 cached ones (SmolLM2's heads, one thread, Intel Xeon):
    AVX-512 (16 lanes) rows / blocks 0.51-0.60 at m = 4, 0.90-1.10 at 8, 1.52-2.10 at 16;
    AVX2 (8 lanes) 0.78-0.83 at 4, 1.10-1.22 at 6, 1.41-1.62 at 8."""
    return lanes // 2 + 1


def prefill_macro(
    paged: bool, h_q: int, h_kv: int, d: int, page_size: int, dtype: str, lanes, window, cap
):
    """A macro: every query head and block of `lanes` query rows, in parallel. A block (query
    head `h`, key/value head `hk`, the query rows `r0..r0+lanes-1` below `total`) runs all
    sequences its rows belong to. Paged: key row j of sequence b lives in page
    `values[indptr[b] + j // page_size]`, slot `j % page_size` of `kv` ([pages, 2, h_kv,
    page_size, d]); ragged: `k[kv_indptr[b] + j]`, `v[...]`."""
    L = lanes
    qscale = 1.0 if cap is not None else LOG2E  # log2(e) folds into q, or applies after the cap

    def cached(kv, which: int, values, base, hk, row, col):
        if paged:
            page = values[base + row // page_size]
            return kv[page, which, hk, row % page_size, col].astype("float32")
        return kv[base + row, hk, col].astype("float32")

    def visible(j, nv, lov, i):
        return T.And(j < nv[i], j >= lov[i])

    @T.macro
    def block(q, h, hk, r0, total, few, sm_scale, causal, seqs, indptr, last_page_len, k, v, values,
              q_indptr, batch_size, q_pos, k_offset, output, lse):  # fmt: skip
        qt = T.sblock_alloc_buffer((d * L,), "float32")  # the queries, [c, row]
        ot = T.sblock_alloc_buffer((d * L,), "float32")  # unnormalised outputs, [c, row]
        s = T.sblock_alloc_buffer((TILE * L,), "float32")  # the tile's scores, then weights
        kt = T.sblock_alloc_buffer((TILE * d,), "float32")  # the tile's key rows
        vt = T.sblock_alloc_buffer((TILE * d,), "float32")  # and value rows
        mx = T.sblock_alloc_buffer((L,), "float32")  # running max per row
        sm = T.sblock_alloc_buffer((L,), "float32")  # running sum per row
        tm = T.sblock_alloc_buffer((L,), "float32")  # the new max per row
        rs = T.sblock_alloc_buffer((L,), "float32")  # the old max's rescale per row
        nv = T.sblock_alloc_buffer((L,), "int32")  # a row's visible keys: [lov, nv)
        lov = T.sblock_alloc_buffer((L,), "int32")
        span = T.sblock_alloc_buffer((2,), "int32")  # the pass's first and end key rows
        mine = T.sblock_alloc_buffer((L,), "int32")  # rows of long sequences: this block's
        owner(seqs, q_indptr, batch_size, r0)
        seqs[1] = seqs[0]  # the block's first sequence, then its last one in seqs[0]
        owner(seqs, q_indptr, batch_size, T.min(r0 + L, total) - 1)
        seqs[2] = 0  # whether a sequence of the block's has `few` rows or more
        for b in range(seqs[1], seqs[0] + 1):
            if q_indptr[b + 1] - q_indptr[b] >= few:
                seqs[2] = 1
        if seqs[2] > 0:
            for i in T.vectorized(L):
                mx[i] = T.float32(NEG)
                sm[i] = T.float32(1.0)
            for c in range(d):
                for i in T.vectorized(L):
                    ot[c * L + i] = T.float32(0)
            for i in range(L):
                for c in range(d):
                    qt[c * L + i] = (
                        T.Cast("float32", q[T.min(r0 + i, total - 1), h, c])
                        * T.abs(sm_scale)
                        * T.float32(qscale)
                    )
            for i in range(L):
                mine[i] = 0
            for b in range(seqs[1], seqs[0] + 1):
                n_q: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                if n_q >= few:
                    n_kv: T.let[T.int32] = kv_length(paged, page_size, indptr, last_page_len, b)
                    span[0] = n_kv
                    span[1] = 0
                    for i in range(L):
                        row: T.let[T.int32] = r0 + i
                        inside: T.let[T.bool] = T.And(
                            T.And(row >= q_indptr[b], row < q_indptr[b + 1]), row < total
                        )
                        if inside:
                            mine[i] = 1
                        nv[i] = T.if_then_else(
                            inside,
                            T.max(
                                0,
                                T.if_then_else(
                                    causal > 0,
                                    T.min(n_kv, n_kv - n_q + (row - q_indptr[b]) + 1),
                                    n_kv,
                                ),
                            ),
                            0,
                        )
                        pos: T.let[T.int32] = q_pos[T.min(row, total - 1)]
                        lov[i] = T.if_then_else(
                            inside, window_start(window, sm_scale, pos, k_offset[b]), 0
                        )
                        if nv[i] > lov[i]:
                            span[0] = T.min(span[0], lov[i])
                            span[1] = T.max(span[1], nv[i])
                    for t in range(span[0] // TILE, (span[1] + TILE - 1) // TILE):
                        j0: T.let[T.int32] = t * TILE
                        for r in range(TILE):
                            for c in T.vectorized(d):
                                kt[r * d + c] = cached(
                                    k, 0, values, indptr[b], hk, T.min(j0 + r, span[1] - 1), c
                                )
                                vt[r * d + c] = cached(
                                    v, 1, values, indptr[b], hk, T.min(j0 + r, span[1] - 1), c
                                )
                        for r in T.unroll(TILE):
                            for i in T.vectorized(L):
                                s[r * L + i] = T.float32(0)
                        for c in range(d):
                            for r in T.unroll(TILE):
                                for i in T.vectorized(L):
                                    s[r * L + i] += kt[r * d + c] * qt[c * L + i]
                        for i in T.vectorized(L):
                            tm[i] = mx[i]
                        for r in T.unroll(TILE):
                            for i in T.vectorized(L):
                                s[r * L + i] = T.Select(
                                    visible(j0 + r, nv, lov, i),
                                    capped(s[r * L + i], cap),
                                    T.float32(NEG),
                                )
                                tm[i] = T.max(tm[i], s[r * L + i])
                        for i in T.vectorized(L):
                            rs[i] = exp2(mx[i] - tm[i])
                            sm[i] *= rs[i]
                            mx[i] = tm[i]
                        for r in T.unroll(TILE):
                            for i in T.vectorized(L):
                                # masked rows weigh exactly 0 (exp2 bottoms out at 2**-126)
                                s[r * L + i] = T.Select(
                                    visible(j0 + r, nv, lov, i),
                                    exp2(s[r * L + i] - mx[i]),
                                    T.float32(0),
                                )
                                sm[i] += s[r * L + i]
                        for c in range(d):
                            for i in T.vectorized(L):
                                ot[c * L + i] *= rs[i]
                            for r in T.unroll(TILE):
                                for i in T.vectorized(L):
                                    ot[c * L + i] += s[r * L + i] * vt[r * d + c]
            for i in range(L):
                if mine[i] > 0:
                    for c in range(d):
                        output[r0 + i, h, c] = T.Cast(dtype, ot[c * L + i] / sm[i])
                    lse[r0 + i, h] = mx[i] + T.log2(sm[i])

    group = h_q // h_kv

    @T.macro
    def every_block(q, total, few, sm_scale, causal, indptr, last_page_len, k, v, values, q_indptr,
                    batch_size, q_pos, k_offset, output, lse):  # fmt: skip
        n_blocks: T.let[T.int32] = (total + L - 1) // L
        for task in T.parallel(h_q * n_blocks):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                seqs = T.sblock_alloc_buffer((3,), "int32")
                # the block's first row, its query and KV heads through memory, where the
                # simplifier cannot bound them: as expressions, TVM 0.27's host passes folded
                # their bounds past int32 for some head counts (6 heads, 16-row blocks)
                at = T.sblock_alloc_buffer((3,), "int32")
                at[0] = zigzag(task % n_blocks, n_blocks) * L
                at[1] = task // n_blocks
                at[2] = at[1] // group
                block(q, at[1], at[2], at[0], total, few, sm_scale, causal, seqs, indptr,
                      last_page_len, k, v, values, q_indptr, batch_size, q_pos, k_offset,
                      output, lse)  # fmt: skip

    return every_block


def prefill_ragged(h_kv: int, h_q: int, d: int, dtype: str, window=None, cap=None, lanes=8):
    """TVM's `batch_prefill_ragged_kv` (the new rows' own keys and values)."""
    blocks = prefill_macro(False, h_q, h_kv, d, 1, dtype, lanes, window, cap)
    rows = every_row(False, h_q, h_kv, d, 1, dtype, lanes, window, cap)
    few = few_rows(lanes)

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
        k_offset = T.match_buffer(
            var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=T.int32()
        )
        q_pos = T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=T.int32())
        output = T.match_buffer(var_output, (qo_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")

        blocks(q, qo_len, few, sm_scale, causal, kv_indptr, kv_indptr, k, v, kv_indptr,
               q_indptr, batch_size, q_pos, k_offset, output, lse)  # fmt: skip
        rows(q, qo_len, few, sm_scale, causal, kv_indptr, kv_indptr, k, v, kv_indptr,
             q_indptr, batch_size, q_pos, k_offset, output, lse)  # fmt: skip

    return prefill_ragged


def prefill_paged(
    h_kv: int, h_q: int, d: int, dtype: str, page_size: int, window=None, cap=None, lanes=8
):
    """TVM's `batch_prefill_paged_kv_cpu` (the new rows against the cache's pages)."""
    blocks = prefill_macro(True, h_q, h_kv, d, page_size, dtype, lanes, window, cap)
    rows = every_row(True, h_q, h_kv, d, page_size, dtype, lanes, window, cap)
    few = few_rows(lanes)

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

        blocks(q, total_len, few, sm_scale, causal, indptr, last_page_len, pages, pages,
               values, q_indptr, batch_size, q_pos, k_offset, output, lse)  # fmt: skip
        rows(q, total_len, few, sm_scale, causal, indptr, last_page_len, pages, pages,
             values, q_indptr, batch_size, q_pos, k_offset, output, lse)  # fmt: skip

    return prefill_paged
