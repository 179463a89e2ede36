"""The CPU decode attention kernel for TVM's paged KV cache: one query row per sequence.

Work item: one sequence and one KV head, with the `group` query heads that share it (GQA),
so each key and value row is read once for all of them. The rows are walked page by page,
`TILE` rows at a time, never across a page boundary: a tile's rows are then consecutive in
memory (one page-table read per page, the row addresses a constant stride apart), and only
a tile that ends early (the sequence's last rows) pays for clamping its row index.

With fewer work items than `MIN_ITEMS` (one SmolLM2 sequence has 3: two threads split them
2:1), each sequence's pages are cut into `SPLITS` parts of consecutive pages, one work item
each, whose normalised outputs and log2-sum-exps a second parallel loop merges. One
sequence, interleaved A/B in a model's step: 5.93 -> 5.45 ms a token at 1000 tokens of
context, 10.64 -> 9.04 ms at 3000, unchanged at 100. Four sequences (12 items) lost 7%
split in 4, so they, and larger batches, run whole.

Per tile and query head:
* 8 dot products, each an 8-lane partial sum over head_dim;
* `row_sums` turns the 8 partial-sum vectors into one vector of 8 scores with 3 levels of
  pairwise adds (x86: 6 `vhaddps`, 2 lane swaps, 1 add), where reducing each row alone
  took 5 shuffles and adds per row;
* the online softmax on that vector: one max, at most one rescale, one vector exp2;
* the value rows accumulated into the output, 8 lanes of head_dim at a time.

Independent accumulators matter more than instruction count here: one FMA chain per row
and head (the previous kernel) waits on the FMA latency, so the scores take `block_rows`
rows and the value pass `block_chunks` slices of head_dim at a time, about 12 chains each.
Measured on SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64), 16 sequences of 48
tokens, one thread, interleaved: 60-85 us against 73-117 us for the previous kernel,
18-27% less.
Pages sit anywhere in the cache, so the hardware prefetchers (which follow addresses) cannot
find the next one: while it reads a page the kernel prefetches the key and value blocks two
pages ahead (the second page before the first; the first page of the thread's next work item
too). In a model's step at 16 sequences (SmolLM2, contexts 32-128, interleaved in one
process), one page ahead took 4% off the whole step (best 29.9 against 31.5 ms, median 35.9
against 37.5 ms); two pages ahead about 1.5% more (medians 49.1 against 49.2 and 45.8
against 47.2 ms, on a busier machine: inside its noise).
On CPUs with AVX-512 (`vector_lanes`) the partial sums and value slices are 16 lanes wide:
half the FMAs and loads; each row's 16 partial sums fold to 8 before `row_sums`. SmolLM2's
shape, 16 sequences of 128 tokens, KV from memory, 2 threads, medians of 25 interleaved
rounds: 183 against 157 us. A model's step at 16 sequences (interleaved in one process):
14.9 against 14.1 ms at contexts 96-160, 23.1 against 21.3 ms at 400-464.
Same signature and results as the cache's own kernel, including the log2-sum-exp `lse`
that the cache uses to merge partial attentions; scores are in the log2 domain as there.
A sliding window (`window`, for layers that pass their scale negated) starts each sequence
at the page holding its window's first row and masks that page's earlier rows; a soft cap
(`cap`) bounds the scores (cpu/attention.py says how both reach the kernel).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..tir_common import LOG2E, add, exp2, maximum, prefetch, reduce_lanes, row_sums

LANES = 8  # f32 lanes of an AVX2 register: the dot products' partial sums
WIDE_LANES = 16  # with AVX-512: the partial sums and value slices of head_dim
TILE = 8  # key rows scored together: must equal LANES (their scores form one vector)
NEG = -5e4  # TVM's kernels start the running max here; masked rows score this
MIN_ITEMS = 6  # fewer work items than this (a sequence or two): pages split into parts
# parts per sequence when there are few; static: a count computed at run time (the items per
# thread) made LLVM take 220 s over this kernel, against 3.6 s for two static copies
SPLITS = 4


def window_start(window, sm_scale, q_pos, k_offset):
    """The first key row (counted from the row at position `k_offset`) a query at `q_pos`
    sees: 0 without a window or in a global layer (sm_scale > 0)."""
    if window is None:
        return 0
    return T.if_then_else(sm_scale < 0, T.max(0, q_pos - k_offset - window + 1), 0)


def capped(score, cap, lanes: int = 1):
    """Scores (q.k * scale) in the log2 domain, soft-capped when `cap` is set."""
    log2e = T.float32(LOG2E) if lanes == 1 else T.Broadcast(T.float32(LOG2E), lanes)
    if cap is None:
        return score
    c = T.float32(cap) if lanes == 1 else T.Broadcast(T.float32(cap), lanes)
    return T.tanh(score / c) * c * log2e


def _part_pages(part, start, n_pages):
    """(first page, end page) of part `part` of a sequence's pages `start..n_pages` (`start`:
    the page of its window's first row, 0 without a window): `SPLITS` parts of consecutive
    pages (the last ones may be empty). A function of the sequence alone, never of the
    batch, so its numbers are too."""
    per = (n_pages - start + SPLITS - 1) // SPLITS
    first = T.min(start + part * per, n_pages)
    return first, T.min(first + per, n_pages)


def _work_item(w, splits, B, indptr, p0):
    """(kv head, sequence, part, the sequence's pages, first page, end page) of item `w`.

    Items are head-major (all sequences of one KV head, then the next head); with `splits`
    = `SPLITS` each part of a sequence is an item, with 1 the item takes all its parts (the
    page range returned is then the whole sequence's from page `p0(b)`, its window's)."""
    hb = w // splits
    part = w % splits
    b = hb % B
    n_pages = indptr[b + 1] - indptr[b]
    if splits == 1:
        return hb // B, b, part, n_pages, p0(b), n_pages
    first, end = _part_pages(part, p0(b), n_pages)
    return hb // B, b, part, n_pages, first, end


def _chosen(first: bool, a, b):
    """`a` if `first` else `b`, decided while the macro expands."""
    return a if first else b


def raise_max_macro(d: int):
    """A macro for head `j`'s online softmax, state `st[4j..4j+3]` (running max, running sum,
    the tile's max, the rescale) and output accumulator `o_acc[j*d..]`: when the tile's max
    beats the running one, the sum and the accumulator scale by 2^(old - new) and the max
    moves up. Shared by decode and prefill (`cpu.attention`)."""

    @T.macro
    def raise_max(st, o_acc, j):
        if st[j * 4 + 2] > st[j * 4]:
            st[j * 4 + 3] = T.exp2(st[j * 4] - st[j * 4 + 2])
            st[j * 4 + 1] *= st[j * 4 + 3]
            for i in T.vectorized(d):
                o_acc[j * d + i] *= st[j * 4 + 3]
            st[j * 4] = st[j * 4 + 2]

    return raise_max


def vector_lanes(target, d: int) -> int:
    """Float lanes per head_dim slice on `target`: 16 where it has AVX-512 (and `d` is a
    multiple of 16), else 8."""
    from tvm.target import codegen

    try:
        wide = bool(codegen.target_has_features("avx512f", target))
    except Exception:  # noqa: BLE001 - an LLVM without x86 support has no such feature
        wide = False
    return WIDE_LANES if wide and d % WIDE_LANES == 0 else LANES


def decode_kernel(
    h_kv: int,
    h_q: int,
    d: int,
    dtype: str,
    page_size: int,
    lanes: int = LANES,
    window: int | None = None,
    cap: float | None = None,
):
    """The kernel for `h_q` query heads over `h_kv` KV heads of size `d` (a multiple of
    `lanes`, the float lanes of each partial sum and value slice: 8, or 16 with AVX-512)."""
    group = h_q // h_kv
    raise_max = raise_max_macro(d)
    vl = lanes
    qscale = 1.0 if cap is not None else LOG2E  # log2(e) folds into q, or follows the cap

    def window_row(q_pos, k_offset, sm_scale):
        """Sequence b -> its first key row in the window (0 without one)."""
        return lambda b: window_start(window, sm_scale, q_pos[b], k_offset[b])

    def window_page(q_pos, k_offset, sm_scale):
        return lambda b: window_row(q_pos, k_offset, sm_scale)(b) // page_size

    nd = d // vl
    tiles = (page_size + TILE - 1) // TILE  # per page; the last may be short
    per_line = 64 // {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]  # elements per line
    page_lines = (page_size * d + per_line - 1) // per_line  # cache lines per head and page

    @T.macro
    def fetch_page(pages, page, hk, wanted):
        if wanted:
            for kv, line in T.grid(2, page_lines):
                address = T.meta_var(
                    T.address_of(pages[page, kv, hk, line * per_line // d, line * per_line % d])
                )
                T.evaluate(prefetch(address))

    # independent accumulators: about 12 of AVX2's 16 vector registers, 24 of AVX-512's 32
    regs = 12 if vl == LANES else 24
    block_rows = max(r for r in (1, 2, 4, 8) if r * group <= regs or r == 1)
    block_chunks = max(c for c in (1, 2, 4, 8) if nd % c == 0 and (c * group <= regs or c == 1))

    def tile_macro(clamped: bool):
        """One tile's scores, softmax update and value rows. `clamped`: some of its rows lie
        past the sequence's end (or the page's); they read the last real row and weigh 0."""

        def slot(first, count, r):
            """The page slot that row `r` of the tile reads."""
            return first + (T.min(r, count - 1) if clamped else r)

        @T.macro
        def tile(pages, page, hk, first, count, skip, qv, o_acc, acc, sc, st):
            # first: the tile's first slot in the page; count: its real rows (1..TILE);
            # skip: its rows before the window (clamped tiles only; they score NEG, weigh 0)
            # scores: `block_rows` rows by `group` heads of 8-lane partial sums at a time, each its
            # own FMA chain (one chain per row and head stalled on the FMA latency)
            for rb in T.serial(TILE // block_rows):
                for j in T.unroll(block_rows):
                    for hg in T.unroll(group):
                        acc[T.Ramp((hg * TILE + rb * block_rows + j) * vl, 1, vl)] = T.Broadcast(
                            T.float32(0), vl
                        )
                for c in T.serial(nd):
                    for j in T.unroll(block_rows):
                        for hg in T.unroll(group):
                            for ln in T.vectorized(vl):
                                acc[(hg * TILE + rb * block_rows + j) * vl + ln] += qv[
                                    hg * d + c * vl + ln
                                ] * T.Cast(
                                    "float32",
                                    pages[
                                        page,
                                        0,
                                        hk,
                                        slot(first, count, rb * block_rows + j),
                                        c * vl + ln,
                                    ],
                                )
            if vl == WIDE_LANES:  # fold each row's 16 partial sums to 8, in place, for row_sums
                for i in T.unroll(group * TILE):
                    acc[T.Ramp(i * LANES, 1, LANES)] = (
                        acc[T.Ramp(i * vl, 1, LANES)] + acc[T.Ramp(i * vl + LANES, 1, LANES)]
                    )
            for hg in T.unroll(group):
                # a clamped row repeats the last real row's score: the max stays right
                sc[T.Ramp(hg * TILE, 1, TILE)] = capped(row_sums(acc, hg * TILE * LANES), cap, TILE)
                if clamped and window is not None:
                    sc[T.Ramp(hg * TILE, 1, TILE)] = T.Select(
                        T.Ramp(0, 1, TILE) < T.Broadcast(skip, TILE),
                        T.Broadcast(T.float32(NEG), TILE),
                        sc.vload([hg * TILE], f"float32x{TILE}"),
                    )
                st[hg * 4 + 2] = reduce_lanes(
                    sc.vload([hg * TILE], f"float32x{TILE}"), TILE, maximum
                )
                raise_max(st, o_acc, hg)
                weights = exp2(
                    sc.vload([hg * TILE], f"float32x{TILE}") - T.Broadcast(st[hg * 4], TILE),
                    TILE,
                )
                if clamped:  # the repeated rows, and those before the window, weigh 0
                    sc[T.Ramp(hg * TILE, 1, TILE)] = T.Select(
                        (T.Ramp(0, 1, TILE) < T.Broadcast(count, TILE))
                        & (T.Ramp(0, 1, TILE) >= T.Broadcast(skip, TILE)),
                        weights,
                        T.Broadcast(T.float32(0), TILE),
                    )
                else:
                    sc[T.Ramp(hg * TILE, 1, TILE)] = weights
                st[hg * 4 + 1] += reduce_lanes(sc.vload([hg * TILE], f"float32x{TILE}"), TILE, add)
            # the value rows: `block_chunks` slices of the output by `group` heads at a time
            for cb in T.serial(nd // block_chunks):
                for r in T.serial(TILE):
                    for i in T.unroll(block_chunks):
                        for hg in T.unroll(group):
                            for ln in T.vectorized(vl):
                                o_acc[hg * d + (cb * block_chunks + i) * vl + ln] += sc[
                                    hg * TILE + r
                                ] * T.Cast(
                                    "float32",
                                    pages[
                                        page,
                                        1,
                                        hk,
                                        slot(first, count, r),
                                        (cb * block_chunks + i) * vl + ln,
                                    ],
                                )

        return tile

    full_tile, short_tile = tile_macro(False), tile_macro(True)

    @T.macro
    def merge_parts(po, pl, base, output, lse, b, h):
        """Head `h` of sequence `b`: its `SPLITS` parts (rows `base..base+SPLITS` of `po`,
        normalised outputs, and `pl`, their log2-sum-exps) weighed by their lse, in part
        order. One macro for both paths, so their arithmetic is the same."""
        merged = T.sblock_alloc_buffer((d,), "float32")
        m = T.sblock_alloc_buffer((2,), "float32")  # the largest lse, the sum
        m[0] = T.float32(NEG)
        m[1] = T.float32(0)
        for i in T.vectorized(d):
            merged[i] = T.float32(0)
        for j in T.serial(SPLITS):
            m[0] = T.max(m[0], pl[base + j])
        for j in T.serial(SPLITS):
            weight: T.let[T.float32] = T.exp2(pl[base + j] - m[0])
            m[1] += weight
            for i in T.vectorized(d):
                merged[i] += weight * po[base + j, i]
        for i in T.vectorized(d):
            output[b, h, i] = T.Cast(dtype, merged[i] / m[1])
        # parts without rows all say NEG: so does a sequence without rows
        lse[b, h] = T.if_then_else(m[0] <= T.float32(NEG), T.float32(NEG), m[0] + T.log2(m[1]))

    def items_macro(splits: int):
        """Attention for every (KV head, sequence, part) work item. `splits` = `SPLITS`:
        each part is an item writing its partial result for `merge`; 1: an item takes its
        sequence's parts one after the other and merges them itself. Either way every part
        starts a fresh softmax and the parts merge in the same order: the numbers do not
        depend on the batch (which decides the path), only the threads' work does."""

        @T.macro
        def items(
            Q, pages, indptr, values, last_page_len, output, lse, part_out, part_lse, B, sm_scale,
            q_pos, k_offset,
        ):  # fmt: skip
            for w in T.parallel(h_kv * B * splits):
                with T.sblock("attn"):
                    T.reads()  # declared, not inferred: the regions depend on page tables
                    T.writes()
                    # per head: output accumulator, scaled query, 4 softmax values (running max,
                    # running sum, the tile's max, the rescale factor); per tile: partial dot
                    # products and scores
                    o_acc = T.sblock_alloc_buffer((group * d,), "float32")
                    qv = T.sblock_alloc_buffer((group * d,), "float32")
                    st = T.sblock_alloc_buffer((group * 4,), "float32")
                    acc = T.sblock_alloc_buffer((group * TILE * vl,), "float32")
                    sc = T.sblock_alloc_buffer((group * TILE,), "float32")
                    # the whole path's parts (a split item's go straight to part_out)
                    po = T.sblock_alloc_buffer((group * SPLITS, d), "float32")
                    pl = T.sblock_alloc_buffer((group * SPLITS,), "float32")
                    item = T.meta_var(
                        _work_item(w, splits, B, indptr, window_page(q_pos, k_offset, sm_scale))
                    )
                    hk: T.let[T.int32] = item[0]
                    b: T.let[T.int32] = item[1]
                    n_pages: T.let[T.int32] = item[3]
                    start: T.let[T.int32] = window_page(q_pos, k_offset, sm_scale)(b)
                    for hg in T.unroll(group):
                        for i in T.vectorized(d):
                            qv[hg * d + i] = (
                                T.Cast("float32", Q[b, hk * group + hg, i])
                                * T.abs(sm_scale)
                                * T.float32(qscale)
                            )
                    # Pages two ahead are prefetched while one is read: pages sit anywhere, so
                    # the hardware prefetchers (which follow addresses) cannot know them. Before
                    # the first page: the second, and the first page of this thread's next task.
                    if w + 1 < h_kv * B * splits:
                        after = T.meta_var(
                            _work_item(
                                w + 1, splits, B, indptr, window_page(q_pos, k_offset, sm_scale)
                            )
                        )
                        fetch_page(
                            pages,
                            values[indptr[after[1]] + after[4]],
                            after[0],
                            after[4] < after[5],
                        )
                    fetch_page(pages, values[indptr[b] + item[4] + 1], hk, item[4] + 1 < item[5])
                    for sub in T.serial(SPLITS // splits):
                        part = T.meta_var(_chosen(splits > 1, item[2], sub))
                        bounds = T.meta_var(_part_pages(part, start, n_pages))
                        first: T.let[T.int32] = bounds[0]
                        end: T.let[T.int32] = bounds[1]
                        for hg in T.unroll(group):
                            st[hg * 4] = T.float32(NEG)
                            st[hg * 4 + 1] = T.float32(1.0)
                            for i in T.vectorized(d):
                                o_acc[hg * d + i] = T.float32(0)
                        for p in T.serial(first, end):
                            page: T.let[T.int32] = values[indptr[b] + p]
                            # two ahead within the item (across its parts on the whole path)
                            fetch_page(pages, values[indptr[b] + p + 2], hk, p + 2 < item[5])
                            filled: T.let[T.int32] = T.if_then_else(
                                p == n_pages - 1, last_page_len[b], page_size
                            )
                            # rows of this page before the window (<= 0: none)
                            skip: T.let[T.int32] = (
                                window_row(q_pos, k_offset, sm_scale)(b) - p * page_size
                            )
                            for t in T.serial(tiles):
                                if t * TILE + TILE <= skip:
                                    T.evaluate(0)  # the whole tile lies before the window
                                elif t * TILE + TILE <= filled and t * TILE >= skip:
                                    full_tile(
                                        pages, page, hk, t * TILE, TILE, 0, qv, o_acc, acc, sc, st
                                    )
                                elif t * TILE < filled:
                                    short_tile(
                                        pages,
                                        page,
                                        hk,
                                        t * TILE,
                                        T.min(filled - t * TILE, TILE),
                                        T.max(skip - t * TILE, 0),
                                        qv,
                                        o_acc,
                                        acc,
                                        sc,
                                        st,
                                    )
                        for hg in T.unroll(group):
                            h: T.let[T.int32] = hk * group + hg
                            if splits == 1:
                                for i in T.vectorized(d):
                                    po[hg * SPLITS + part, i] = o_acc[hg * d + i] / st[hg * 4 + 1]
                                pl[hg * SPLITS + part] = st[hg * 4] + T.log2(st[hg * 4 + 1])
                            else:
                                for i in T.vectorized(d):
                                    part_out[(b * h_q + h) * SPLITS + part, i] = (
                                        o_acc[hg * d + i] / st[hg * 4 + 1]
                                    )
                                part_lse[(b * h_q + h) * SPLITS + part] = st[hg * 4] + T.log2(
                                    st[hg * 4 + 1]
                                )
                    if splits == 1:
                        for hg in T.unroll(group):
                            merge_parts(po, pl, hg * SPLITS, output, lse, b, hk * group + hg)

        return items

    @T.macro
    def merge(output, lse, part_out, part_lse, B):
        """Each head's parts weighed by their log2-sum-exp (base 2, as the scores)."""
        for bh in T.parallel(B * h_q):
            with T.sblock("merge"):
                T.reads(part_out[bh * SPLITS : bh * SPLITS + SPLITS, 0:d])
                T.writes(output[bh // h_q, bh % h_q, 0:d], lse[bh // h_q, bh % h_q])
                merge_parts(part_out, part_lse, bh * SPLITS, output, lse, bh // h_q, bh % h_q)

    whole_items, split_items = items_macro(1), items_macro(SPLITS)

    @T.prim_func(s_tir=True)
    def decode(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        Q = T.match_buffer(Q_handle, (B, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), dtype)
        indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32", elem_offset=T.int32())
        values = T.match_buffer(
            page_table_values_handle, (nnz_pages,), "int32", elem_offset=T.int32()
        )
        output = T.match_buffer(output_handle, (B, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (B, h_q), "float32")
        last_page_len = T.match_buffer(var_length_info, (B,), "int32", elem_offset=T.int32())
        # positions (windows): each sequence's first key row's and its query's
        k_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=T.int32())
        q_pos = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=T.int32())

        # With MIN_ITEMS KV heads or more every batch has enough items: the split path is
        # not emitted at all (inside `h_kv * B < MIN_ITEMS` the analyzer would conclude B = 0
        # and refuse the path's `% B` as a division by zero: Llama-3.2-1B's 8 KV heads).
        if h_kv >= MIN_ITEMS or h_kv * B >= MIN_ITEMS:
            whole_items(
                Q, pages, indptr, values, last_page_len, output, lse, None, None, B, sm_scale,
                q_pos, k_offset,
            )  # fmt: skip
        else:
            with T.sblock("split"):
                # a few sequences: each one's pages in `SPLITS` parts, merged after through
                # their log2-sum-exp (the buffers only here: the common case allocates none)
                T.reads()
                T.writes()
                part_out = T.sblock_alloc_buffer((B * h_q * SPLITS, d), "float32")
                part_lse = T.sblock_alloc_buffer((B * h_q * SPLITS,), "float32")
                split_items(
                    Q, pages, indptr, values, last_page_len, output, lse, part_out, part_lse, B,
                    sm_scale, q_pos, k_offset,
                )  # fmt: skip
                merge(output, lse, part_out, part_lse, B)

    return decode
