"""Mixture-of-experts kernels, written scheduled for the CPU (LLVM) or a GPU: routing, the
grouping of (token, slot) pairs by expert, the grouped matmul, all data-dependent loops that
neither our CPU rules nor dlight could schedule from a plain definition.

A step's `T` tokens each pick `K` experts: `N = T * K` pairs.

* `route_kernel`: router logits [T, E] -> the weights [T, K] (float32) and the expert ids
  [T, K] of each token's top K: softmax over all experts in float32, the K largest (ties
  go to the lower expert id), renormalised to sum 1 when the family does (Mixtral,
  Qwen3-MoE) or not (Qwen2-MoE), as transformers does.
* `group_kernel`: a counting sort of the pairs by expert: `indptr` [E + 1] (expert e's rows
  are `indptr[e]..indptr[e + 1]` of the sorted order), `rows` [N] (the token of each sorted
  row), `slot` [N] (the sorted row of pair t * K + k) and `active` [E + 1] (active[0]
  experts have rows; their ids follow). O(N + E) on one thread: microseconds next to the
  matmuls.
* `combine_kernel`: each token's k expert rows summed, weighted by the router.
* `grouped_matmul_kernel`: `y[r, :] = x[rows[r]] @ W_e^T` (or `x[r]` for the down
  projection, whose input is already in sorted order) for the rows r of every active expert
  e, with W the stacked [E * n, k] weight, float or GGUF blocks (dequantized inside, never
  stored as float). Experts without rows cost nothing; each active expert's weights are
  read (and decoded) once per step, whatever its row count. (AVX-512 VNNI CPUs: int8
  activations for quantized stacks, `cpu/moe_int8.py`.)

CPU schedule of the grouped matmul: the output columns in chunks on the thread pool (every
thread walks every active expert, so the work splits evenly whichever experts are picked);
per expert, `NT` weight rows are decoded into a float32 scratch (L1) and then serve all of
the expert's rows, `ROWS` at a time: `ROWS * NT` vector accumulators over `LANES`-wide
slices of k, so each loaded vector feeds several FMAs. GPU: one thread per output column,
`ROWS` rows at a time; simple, for the default GPU rules to compile (no tensor cores).
"""

from __future__ import annotations

from tvm.script import tirx as T

from tallow.model_defs.quant_ops import dequant_value, row_bytes

from .tir_common import add, reduce_lanes

LANES = 8  # f32 lanes of the CPU partial sums (AVX2 register)
NT = 4  # weight rows decoded together on the CPU
ROWS = 4  # token rows sharing one pass over the decoded weight rows
GPU_THREADS = 64  # threads per block: tokens (routing), output columns (matmul)
NEG_INF = -3.0e38

_ATTRS = {"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8}  # 8: opaque


def route_kernel(experts: int, top_k: int, normalise: bool, dtype: str, gpu: bool):
    @T.macro
    def route_token(logits, w, ids, t, p, taken):
        # p[0:E] the probabilities; after them the max logit, the sum of exponentials,
        # the picked experts' sum, the best probability of the current pick
        p[experts] = T.float32(NEG_INF)
        for e in T.serial(experts):
            p[experts] = T.max(p[experts], T.Cast("float32", logits[t, e]))
        p[experts + 1] = T.float32(0)
        for e in T.serial(experts):
            p[e] = T.exp(T.Cast("float32", logits[t, e]) - p[experts])
            p[experts + 1] += p[e]
            taken[e] = 0
        p[experts + 2] = T.float32(0)  # the picked experts' sum
        for k in T.serial(top_k):
            ids[t, k] = -1
            p[experts + 3] = T.float32(-1)
            for e in T.serial(experts):
                if taken[e] == 0 and p[e] > p[experts + 3]:
                    p[experts + 3] = p[e]
                    ids[t, k] = e
            taken[ids[t, k]] = 1
            w[t, k] = p[experts + 3] / p[experts + 1]
            p[experts + 2] += w[t, k]
        if normalise:
            for k in T.serial(top_k):
                w[t, k] = w[t, k] / p[experts + 2]

    if gpu:

        @T.prim_func(private=True, s_tir=True)
        def route_gpu(var_logits: T.handle, var_w: T.handle, var_ids: T.handle):
            T.func_attr(_ATTRS)
            n = T.int32()
            logits = T.match_buffer(var_logits, (n, experts), dtype)
            w = T.match_buffer(var_w, (n, top_k), "float32")
            ids = T.match_buffer(var_ids, (n, top_k), "int32")
            for bx in T.thread_binding((n + GPU_THREADS - 1) // GPU_THREADS, "blockIdx.x"):
                for tx in T.thread_binding(GPU_THREADS, "threadIdx.x"):
                    with T.sblock("route"):
                        T.reads()
                        T.writes()
                        p = T.sblock_alloc_buffer((experts + 4,), "float32", scope="local")
                        taken = T.sblock_alloc_buffer((experts,), "int32", scope="local")
                        if bx * GPU_THREADS + tx < n:
                            route_token(logits, w, ids, bx * GPU_THREADS + tx, p, taken)

        return route_gpu

    @T.prim_func(private=True, s_tir=True)
    def route_cpu(var_logits: T.handle, var_w: T.handle, var_ids: T.handle):
        T.func_attr(_ATTRS)
        n = T.int32()
        logits = T.match_buffer(var_logits, (n, experts), dtype)
        w = T.match_buffer(var_w, (n, top_k), "float32")
        ids = T.match_buffer(var_ids, (n, top_k), "int32")
        for t in T.parallel(n):
            with T.sblock("route"):
                T.reads()
                T.writes()
                p = T.sblock_alloc_buffer((experts + 4,), "float32")
                taken = T.sblock_alloc_buffer((experts,), "int32")
                route_token(logits, w, ids, t, p, taken)

    return route_cpu


def group_kernel(experts: int, top_k: int, gpu: bool):
    @T.macro
    def group(ids, indptr, rows, slot, active, n, count):
        for e in T.serial(experts):
            count[e] = 0
        for q in T.serial(n * top_k):
            count[ids[q // top_k, q % top_k]] += 1
        indptr[0] = 0
        active[0] = 0
        for e in T.serial(experts):
            indptr[e + 1] = indptr[e] + count[e]
            if count[e] > 0:
                active[active[0] + 1] = e
                active[0] = active[0] + 1
            count[e] = indptr[e]  # now the next free row of expert e
        for q in T.serial(n * top_k):
            e: T.let[T.int32] = ids[q // top_k, q % top_k]
            rows[count[e]] = q // top_k
            slot[q] = count[e]
            count[e] = count[e] + 1

    if gpu:

        @T.prim_func(private=True, s_tir=True)
        def group_gpu(
            var_ids: T.handle,
            var_indptr: T.handle,
            var_rows: T.handle,
            var_slot: T.handle,
            var_active: T.handle,
        ):
            T.func_attr(_ATTRS)
            n = T.int32()
            ids = T.match_buffer(var_ids, (n, top_k), "int32")
            indptr = T.match_buffer(var_indptr, (experts + 1,), "int32")
            rows = T.match_buffer(var_rows, (n * top_k,), "int32")
            slot = T.match_buffer(var_slot, (n * top_k,), "int32")
            active = T.match_buffer(var_active, (experts + 1,), "int32")
            for _bx in T.thread_binding(1, "blockIdx.x"):
                for _tx in T.thread_binding(1, "threadIdx.x"):
                    with T.sblock("group"):
                        T.reads()
                        T.writes()
                        count = T.sblock_alloc_buffer((experts,), "int32", scope="local")
                        group(ids, indptr, rows, slot, active, n, count)

        return group_gpu

    @T.prim_func(private=True, s_tir=True)
    def group_cpu(
        var_ids: T.handle,
        var_indptr: T.handle,
        var_rows: T.handle,
        var_slot: T.handle,
        var_active: T.handle,
    ):
        T.func_attr(_ATTRS)
        n = T.int32()
        ids = T.match_buffer(var_ids, (n, top_k), "int32")
        indptr = T.match_buffer(var_indptr, (experts + 1,), "int32")
        rows = T.match_buffer(var_rows, (n * top_k,), "int32")
        slot = T.match_buffer(var_slot, (n * top_k,), "int32")
        active = T.match_buffer(var_active, (experts + 1,), "int32")
        with T.sblock("group"):
            T.reads()
            T.writes()
            count = T.sblock_alloc_buffer((experts,), "int32")
            group(ids, indptr, rows, slot, active, n, count)

    return group_cpu


def _chunk(n_out: int, unit: int, preferred: int) -> int:
    """The largest multiple of `unit` up to `preferred` that divides `n_out` (else `unit`)."""
    for c in range(preferred, unit - 1, -unit):
        if n_out % c == 0:
            return c
    return unit


def grouped_matmul_kernel(
    experts: int,
    n_out: int,
    k_dim: int,
    qtype: str,
    x_dtype: str,
    w_dtype: str,
    gather: bool,
    gpu: bool,
):
    """`y [N, n_out]` from `x` ([tokens, k] read through `rows` when `gather`, else [N, k]),
    `rows`, `indptr`, `active` (see `group_kernel`) and the stacked weight `w`."""
    w_cols = row_bytes(qtype, k_dim) if qtype != "none" else k_dim
    w_dtype = "uint8" if qtype != "none" else w_dtype

    def weight(w, row, col):
        if qtype == "none":
            return T.Cast("float32", w[row, col])
        return dequant_value(lambda b: w[row, b], qtype, col)

    def x_at(x, rows, r, col):
        return T.Cast("float32", x[rows[r], col] if gather else x[r, col])

    if gpu:
        return _grouped_gpu(experts, n_out, k_dim, w_cols, w_dtype, x_dtype, weight, x_at)
    lanes = LANES if k_dim % LANES == 0 else 1
    nt = NT if n_out % NT == 0 else 1
    chunk = _chunk(n_out, nt, 16)
    kv = k_dim // lanes

    def lane_sum(acc, start):
        # one lane (k not a multiple of LANES, e.g. a tensor-parallel worker's 12 of an
        # expert's 48 columns): TVM takes no 1-lane Ramp
        if lanes == 1:
            return acc[start]
        return reduce_lanes(acc[T.Ramp(start, 1, lanes)], lanes, add)

    @T.macro
    def one_row(x, rows, y, wt, acc, r, n0):
        for a in T.unroll(nt):
            for ln in T.vectorized(lanes):
                acc[a * lanes + ln] = T.float32(0)
        for kk in T.serial(kv):
            for a in T.unroll(nt):
                for ln in T.vectorized(lanes):
                    acc[a * lanes + ln] += (
                        x_at(x, rows, r, kk * lanes + ln) * wt[a * k_dim + kk * lanes + ln]
                    )
        for a in T.unroll(nt):
            y[r, n0 + a] = T.Cast(x_dtype, lane_sum(acc, a * lanes))

    @T.macro
    def row_tile(x, rows, y, wt, acc, r0, n0):
        for i in T.unroll(ROWS * nt):
            for ln in T.vectorized(lanes):
                acc[i * lanes + ln] = T.float32(0)
        for kk in T.serial(kv):
            for r in T.unroll(ROWS):
                for a in T.unroll(nt):
                    for ln in T.vectorized(lanes):
                        acc[(r * nt + a) * lanes + ln] += (
                            x_at(x, rows, r0 + r, kk * lanes + ln) * wt[a * k_dim + kk * lanes + ln]
                        )
        for r in T.unroll(ROWS):
            for a in T.unroll(nt):
                y[r0 + r, n0 + a] = T.Cast(x_dtype, lane_sum(acc, (r * nt + a) * lanes))

    @T.prim_func(private=True, s_tir=True)
    def grouped_cpu(
        var_x: T.handle,
        var_rows: T.handle,
        var_indptr: T.handle,
        var_active: T.handle,
        var_w: T.handle,
        var_y: T.handle,
    ):
        T.func_attr(_ATTRS)
        m = T.int32()
        n = T.int32()
        x = T.match_buffer(var_x, (m, k_dim), x_dtype)
        rows = T.match_buffer(var_rows, (n,), "int32")
        indptr = T.match_buffer(var_indptr, (experts + 1,), "int32")
        active = T.match_buffer(var_active, (experts + 1,), "int32")
        w = T.match_buffer(var_w, (experts * n_out, w_cols), w_dtype)
        y = T.match_buffer(var_y, (n, n_out), x_dtype)
        for c in T.parallel(n_out // chunk):
            with T.sblock("grouped_matmul"):
                T.reads()
                T.writes()
                wt = T.sblock_alloc_buffer((nt * k_dim,), "float32")
                acc = T.sblock_alloc_buffer((ROWS * nt * lanes,), "float32")
                for j in T.serial(active[0]):
                    e: T.let[T.int32] = active[j + 1]
                    lo: T.let[T.int32] = indptr[e]
                    count: T.let[T.int32] = indptr[e + 1] - indptr[e]
                    for t in T.serial(chunk // nt):
                        n0: T.let[T.int32] = c * chunk + t * nt
                        for a in T.serial(nt):
                            for kk in T.serial(kv):
                                for ln in T.vectorized(lanes):
                                    wt[a * k_dim + kk * lanes + ln] = weight(
                                        w, e * n_out + n0 + a, kk * lanes + ln
                                    )
                        for rt in T.serial(count // ROWS):
                            row_tile(x, rows, y, wt, acc, lo + rt * ROWS, n0)
                        for r in T.serial(count % ROWS):
                            one_row(x, rows, y, wt, acc, lo + count // ROWS * ROWS + r, n0)

    return grouped_cpu


def _grouped_gpu(experts, n_out, k_dim, w_cols, w_dtype, x_dtype, weight, x_at):
    threads = _chunk(n_out, 1, GPU_THREADS)

    @T.prim_func(private=True, s_tir=True)
    def grouped_gpu(
        var_x: T.handle,
        var_rows: T.handle,
        var_indptr: T.handle,
        var_active: T.handle,
        var_w: T.handle,
        var_y: T.handle,
    ):
        T.func_attr(_ATTRS)
        m = T.int32()
        n = T.int32()
        x = T.match_buffer(var_x, (m, k_dim), x_dtype)
        rows = T.match_buffer(var_rows, (n,), "int32")
        indptr = T.match_buffer(var_indptr, (experts + 1,), "int32")
        active = T.match_buffer(var_active, (experts + 1,), "int32")
        w = T.match_buffer(var_w, (experts * n_out, w_cols), w_dtype)
        y = T.match_buffer(var_y, (n, n_out), x_dtype)
        for bx in T.thread_binding(n_out // threads, "blockIdx.x"):
            for tx in T.thread_binding(threads, "threadIdx.x"):
                with T.sblock("grouped_matmul"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((ROWS,), "float32", scope="local")
                    wv = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    col: T.let[T.int32] = bx * threads + tx
                    for j in T.serial(active[0]):
                        e: T.let[T.int32] = active[j + 1]
                        lo: T.let[T.int32] = indptr[e]
                        count: T.let[T.int32] = indptr[e + 1] - indptr[e]
                        for rt in T.serial((count + ROWS - 1) // ROWS):
                            for r in T.unroll(ROWS):
                                acc[r] = T.float32(0)
                            for k in T.serial(k_dim):
                                wv[0] = weight(w, e * n_out + col, k)
                                for r in T.unroll(ROWS):
                                    acc[r] += (
                                        x_at(x, rows, lo + T.min(rt * ROWS + r, count - 1), k)
                                        * wv[0]
                                    )
                            for r in T.unroll(ROWS):
                                if rt * ROWS + r < count:
                                    y[lo + rt * ROWS + r, col] = T.Cast(x_dtype, acc[r])

    return grouped_gpu


def combine_kernel(hidden: int, top_k: int, dtype: str, gpu: bool):
    """out[t] = sum_k weights[t, k] * y[slot[t * top_k + k]]: each token's expert rows back,
    weighted by the router (the weight cast to the rows' dtype first, as transformers does)."""
    lanes = LANES if hidden % LANES == 0 else 1

    def total(y, slot, w, t, col):
        value = None
        for k in range(top_k):
            term = T.Cast(dtype, w[t, k]) * y[slot[t * top_k + k], col]
            value = term if value is None else value + term
        return value

    if gpu:
        threads = _chunk(hidden, 1, GPU_THREADS)

        @T.prim_func(private=True, s_tir=True)
        def combine_gpu(var_y: T.handle, var_slot: T.handle, var_w: T.handle, var_out: T.handle):
            T.func_attr(_ATTRS)
            n = T.int32()
            m = T.int32()
            y = T.match_buffer(var_y, (m, hidden), dtype)
            slot = T.match_buffer(var_slot, (m,), "int32")
            w = T.match_buffer(var_w, (n, top_k), "float32")
            out = T.match_buffer(var_out, (n, hidden), dtype)
            for t in T.thread_binding(n, "blockIdx.x"):
                for c in T.thread_binding(threads, "threadIdx.x"):
                    with T.sblock("combine"):
                        T.reads()
                        T.writes()
                        for i in T.serial(hidden // threads):
                            out[t, i * threads + c] = total(y, slot, w, t, i * threads + c)

        return combine_gpu

    @T.prim_func(private=True, s_tir=True)
    def combine_cpu(var_y: T.handle, var_slot: T.handle, var_w: T.handle, var_out: T.handle):
        T.func_attr(_ATTRS)
        n = T.int32()
        m = T.int32()
        y = T.match_buffer(var_y, (m, hidden), dtype)
        slot = T.match_buffer(var_slot, (m,), "int32")
        w = T.match_buffer(var_w, (n, top_k), "float32")
        out = T.match_buffer(var_out, (n, hidden), dtype)
        for t in T.parallel(n):
            with T.sblock("combine"):
                T.reads()
                T.writes()
                for i in T.serial(hidden // lanes):
                    for ln in T.vectorized(lanes):
                        out[t, i * lanes + ln] = total(y, slot, w, t, i * lanes + ln)

    return combine_cpu
