"""Prefill attention one query row at a time: the path for a sequence with few new rows.

A speculative verification (2-5 rows), the last rows of a prompt cut on a chunk grid, a
short prompt: below `attention_prefill.few_rows` rows a sequence's rows go through this
kernel, which costs per row, not per block of 16. (The blocked kernel's fixed cost per block
made a 2-row forward of SmolLM2 7.0 -> 8.0 ms, more than the 4.9 ms decode step it was to
save, and the speculation policy stopped proposing.) A task is (block of query heads, query
row):

* the rows in zigzag order (0, n-1, 1, n-2, ...) so that the thread pool's contiguous shares
  of the tasks carry equal work;
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
* one pass over the key rows with an online softmax, 8 rows (`TILE`) at a time: their
  scores, one max, at most one rescale, and one vector exp2 (a polynomial,
  `tir_common.exp2`: libm's exp2f is a scalar call per row and was a third of the time).

A row's result depends on nothing but its own sequence's keys: the same bits whatever else
the call holds.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from ..tir_common import LOG2E, add, exp2, reduce_lanes
from .attention_decode import (
    LANES,
    NEG,
    TILE,
    capped,
    raise_max_macro,
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
def owner(seq, q_indptr, batch_size, row):
    """seq[0] = the sequence whose query rows include `row`."""
    seq[0] = 0
    for s in T.serial(batch_size):
        if q_indptr[s + 1] <= row:
            seq[0] = s + 1


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


def kv_length(paged: bool, page_size: int, indptr, last_page_len, b):
    """Key rows of sequence b: ragged, its span of `indptr`; paged, its pages'."""
    if not paged:
        return indptr[b + 1] - indptr[b]
    n_pages = indptr[b + 1] - indptr[b]
    return T.if_then_else(n_pages > 0, (n_pages - 1) * page_size + last_page_len[b], 0)


def every_row(
    paged: bool, h_q: int, h_kv: int, d: int, page_size: int, dtype: str, lanes, window, cap
):
    """A macro: every (head block, query row) of the sequences with fewer than `few` new rows,
    in parallel; the other rows' tasks return at once. Paged: `indptr` counts pages and
    `values` lists them; ragged: `indptr` counts key rows of `k` and `v`."""
    group = h_q // h_kv
    heads = heads_per_block(group)
    attend = _attend(paged, d, page_size, dtype, heads, cap, lanes)

    @T.macro
    def rows(q, total, few, sm_scale, causal, indptr, last_page_len, k, v, values, q_indptr,
             batch_size, q_pos, k_offset, output, lse):  # fmt: skip
        for hr in T.parallel(h_q // heads * total):
            with T.sblock("attn_rows"):
                T.reads()
                T.writes()
                seq = T.sblock_alloc_buffer((1,), "int32")
                h: T.let[T.int32] = hr // total * heads
                row: T.let[T.int32] = zigzag(hr % total, total)
                owner(seq, q_indptr, batch_size, row)
                b: T.let[T.int32] = seq[0]
                n_q: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                if n_q < few:
                    n_kv: T.let[T.int32] = kv_length(paged, page_size, indptr, last_page_len, b)
                    n: T.let[T.int32] = T.max(
                        0,
                        T.if_then_else(
                            causal > 0, T.min(n_kv, n_kv - n_q + (row - q_indptr[b]) + 1), n_kv
                        ),
                    )
                    lo: T.let[T.int32] = window_start(window, sm_scale, q_pos[row], k_offset[b])
                    attend(q, row, h, sm_scale, lo, n, k, v, values, indptr[b], h // group,
                           output, lse)  # fmt: skip

    return rows
