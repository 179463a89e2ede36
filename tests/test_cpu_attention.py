"""Our CPU attention kernels (tallow.schedules.cpu.attention_decode, attention_prefill and
attention_rows) against numpy attention.

Each kernel runs on a paged or ragged batch of several sequences of different lengths
(pages shuffled in the pool, GQA with 3 query heads per KV head), and its output and
log2-sum-exp equal a plain numpy softmax attention over the rows each query may see.
A compiled model using them is checked against transformers in test_parity.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tallow.schedules.cpu import attention_prefill as ap
from tallow.schedules.cpu.attention_decode import decode_kernel, vector_lanes
from tallow.schedules.cpu.attention_rows import heads_per_block

H_KV, H_Q, D, PAGE = 3, 9, 64, 16
SM = D**-0.5
LOG2E = np.log2(np.e)


@pytest.fixture(scope="module")
def target():
    cpu = tvm.get_global_func("target.llvm_get_system_cpu")()
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu})


def _t(a, dtype="int32"):
    return tvm.runtime.tensor(np.asarray(a, dtype), tvm.cpu())


def _attend(q, k, v, visible):
    """numpy oracle: q [h_q, d] over the first `visible` rows of k, v [n, h_kv, d]."""
    (h_q, d), h_kv = q.shape, k.shape[1]
    g = h_q // h_kv
    out, lse = np.zeros((h_q, d)), np.full(h_q, -5e4)
    if visible == 0:
        return out, lse
    for h in range(h_q):
        s = k[:visible, h // g].astype(np.float64) @ q[h] * d**-0.5 * LOG2E
        p = np.exp2(s - s.max())
        out[h] = p @ v[:visible, h // g] / p.sum()
        lse[h] = s.max() + np.log2(p.sum())
    return out, lse


def _paged(rng, lengths, h_kv=H_KV, d=D, page=PAGE):
    """A shuffled page pool holding `lengths` tokens per sequence; the rows in order.
    The slots past each sequence's end hold NaN: a kernel that reads them shows it."""
    counts = [-(-n // page) for n in lengths]
    pool = rng.standard_normal((sum(counts) + 3, 2, h_kv, page, d)).astype("float32")
    order = rng.permutation(len(pool))
    indptr, values = [0], []
    for c in counts:
        values += list(order[len(values) : len(values) + c])
        indptr.append(len(values))
    last = [n - (c - 1) * page if c else 0 for n, c in zip(lengths, counts, strict=True)]
    for b, c in enumerate(counts):
        if c:
            pool[values[indptr[b] + c - 1], :, :, last[b] :] = np.nan
    rows = []
    for b, n in enumerate(lengths):
        r = [pool[values[indptr[b] + j // page], :, :, j % page] for j in range(n)]
        empty = np.zeros((0, h_kv, d), "float32")
        rows.append(
            (
                np.stack([x[0] for x in r]) if r else empty,
                np.stack([x[1] for x in r]) if r else empty,
            )
        )
    return pool, indptr, values, last, rows


def _build(func, target):
    return tvm.compile(tvm.IRModule({"main": func}), target=target)["main"]


_DECODE_KERNELS: dict = {}


def _decode(target, h_kv, h_q, d, page, lanes):
    """The decode kernel of this shape, built once per test run (10-20 s each here)."""
    key = (str(target), h_kv, h_q, d, page, lanes)
    if key not in _DECODE_KERNELS:
        _DECODE_KERNELS[key] = _build(decode_kernel(h_kv, h_q, d, "float32", page, lanes), target)
    return _DECODE_KERNELS[key]


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize(
    ("h_kv", "h_q", "d", "page"),
    [(3, 9, 64, 16), (1, 4, 256, 16), (2, 2, 32, 12)],
    ids=["smollm2", "gemma3-270m", "mha-page12"],
)
def test_decode_matches_numpy(target, h_kv, h_q, d, page, lanes):
    """Lengths around tile (8) and page boundaries, an empty sequence, a long one; with
    8-lane vectors (AVX2) and, where the CPU has AVX-512, 16-lane ones. Enough work items
    (KV heads x sequences) that each sequence runs whole."""
    _check_decode(target, h_kv, h_q, d, page, lanes, [1, 8, 16, 17, 0, 23, 70])


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize(
    ("h_kv", "h_q", "d", "page", "lengths"),
    [
        (3, 9, 64, 16, [70]),
        (3, 9, 64, 16, [300]),
        (1, 4, 256, 16, [0, 129, 5]),
        (2, 2, 32, 12, [33, 0]),
        (8, 32, 64, 16, [70]),
    ],
    ids=["smollm2-70", "smollm2-300", "gemma3-270m", "mha-page12", "llama3.2-1b-one-seq"],
)
def test_decode_splits_few_sequences(target, h_kv, h_q, d, page, lengths, lanes):
    """Fewer work items than `MIN_ITEMS` (one SmolLM2 sequence: 3 KV heads): each
    sequence's pages in `SPLITS` parts, then merged by their log2-sum-exp (some parts empty:
    a 5-token sequence has one page); an empty sequence still gives zeros and lse -5e4.
    With `MIN_ITEMS` KV heads or more (Llama-3.2-1B, Mistral 7B, Qwen3-8B: 8) one sequence
    runs whole: that kernel once failed to build (a division by a batch proven 0)."""
    _check_decode(target, h_kv, h_q, d, page, lanes, lengths)


def _check_decode(target, h_kv, h_q, d, page, lanes, lengths):
    if lanes > vector_lanes(target, d):
        pytest.skip("this CPU has no AVX-512")
    rng = np.random.default_rng(0)
    pool, indptr, values, last, rows = _paged(rng, lengths, h_kv, d, page)
    q = rng.standard_normal((len(lengths), h_q, d)).astype("float32")
    out, lse = _t(np.zeros(q.shape), "float32"), _t(np.zeros(q.shape[:2]), "float32")
    zeros = np.zeros(len(lengths))
    kernel = _decode(target, h_kv, h_q, d, page, lanes)
    kernel(_t(q, "float32"), _t(pool, "float32"), _t(indptr), _t(values), _t(last),
           _t(zeros), _t(zeros), out, lse, 0, 1.0, 1e4, d**-0.5)  # fmt: skip
    for b, n in enumerate(lengths):
        want_out, want_lse = _attend(q[b], *rows[b], n)
        np.testing.assert_allclose(out.numpy()[b], want_out, atol=2e-6)
        np.testing.assert_allclose(lse.numpy()[b], want_lse, rtol=1e-6, atol=1e-5)


def test_decode_is_batch_invariant(target):
    """A sequence's output and lse are the same bits alone (3 work items: the split path, its
    parts on separate threads) and in a batch (the whole path, one item per sequence and
    head): `--deterministic` serving relies on it. Lengths with 1, 2, 5 and 19 pages."""
    rng = np.random.default_rng(5)
    lengths = [9, 20, 70, 300]
    pool, indptr, values, last, _ = _paged(rng, lengths)
    q = rng.standard_normal((len(lengths), H_Q, D)).astype("float32")
    kernel = _decode(target, H_KV, H_Q, D, PAGE, vector_lanes(target, D))

    def run(seqs):
        sub_indptr = np.cumsum([0] + [indptr[b + 1] - indptr[b] for b in seqs])
        sub_values = [v for b in seqs for v in values[indptr[b] : indptr[b + 1]]]
        out = _t(np.zeros((len(seqs), H_Q, D)), "float32")
        lse = _t(np.zeros((len(seqs), H_Q)), "float32")
        zeros = np.zeros(len(seqs))
        lasts = [last[b] for b in seqs]
        kernel(_t(q[seqs], "float32"), _t(pool, "float32"), _t(sub_indptr), _t(sub_values),
               _t(lasts), _t(zeros), _t(zeros), out, lse, 0, 1.0, 1e4, SM)  # fmt: skip
        return out.numpy(), lse.numpy()

    together = run(list(range(len(lengths))))
    for b in range(len(lengths)):
        alone = run([b])
        np.testing.assert_array_equal(alone[0][0], together[0][b])
        np.testing.assert_array_equal(alone[1][0], together[1][b])


# (h_kv, h_q, d): query heads per KV head 3 (SmolLM2), 4, 6 (blocks of 3), 5 (one at a time:
# no divisor up to MAX_HEADS), 1; head_dim 64 and 128
PREFILL_HEADS = [(3, 9, 64), (2, 8, 128), (1, 6, 64), (1, 5, 64), (4, 4, 64)]


def test_heads_per_block():
    assert [heads_per_block(g) for g in (1, 2, 3, 4, 5, 6, 7, 8, 12)] == [
        1, 2, 3, 4, 1, 3, 1, 4, 4,
    ]  # fmt: skip


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize(("h_kv", "h_q", "d"), PREFILL_HEADS)
def test_prefill_ragged_matches_numpy(target, causal, h_kv, h_q, d, lanes):
    """Every row of every head, against numpy. Sequences of `few_rows` rows or more (16
    lanes: 33; 8 lanes: 5, 33, 8) go through blocks of 8 or 16 query rows (16: AVX-512;
    elsewhere LLVM splits the vectors), one block spanning three sequences (rows 0-4, 5 and
    6-38); the others through the row kernel, with the heads of a KV head together
    (`heads_per_block`)."""
    assert (ap.few_rows(8), ap.few_rows(16)) == (5, 9)  # the lengths below straddle them
    rng = np.random.default_rng(1)
    q_lens, kv_lens = [5, 1, 33, 8], [5, 4, 40, 9]  # kv longer than q: queries are the last
    q = rng.standard_normal((sum(q_lens), h_q, d)).astype("float32")
    k = rng.standard_normal((sum(kv_lens), h_kv, d)).astype("float32")
    v = rng.standard_normal((sum(kv_lens), h_kv, d)).astype("float32")
    q_ptr, kv_ptr = np.cumsum([0, *q_lens]), np.cumsum([0, *kv_lens])
    out, lse = _t(np.zeros(q.shape), "float32"), _t(np.zeros(q.shape[:2]), "float32")
    kernel = _build(ap.prefill_ragged(h_kv, h_q, d, "float32", lanes=lanes), target)
    sm = d**-0.5
    kernel(_t(q, "float32"), _t(q_ptr), _t(k, "float32"), _t(v, "float32"), _t(kv_ptr),
           _t(np.zeros(len(q))), _t(np.zeros(4)), out, lse, causal, 0, 1.0, 1e4, sm)  # fmt: skip
    for b in range(4):
        kb, vb = k[kv_ptr[b] : kv_ptr[b + 1]], v[kv_ptr[b] : kv_ptr[b + 1]]
        for i in range(q_lens[b]):
            visible = kv_lens[b] - q_lens[b] + i + 1 if causal else kv_lens[b]
            want_out, want_lse = _attend(q[q_ptr[b] + i], kb, vb, visible)
            np.testing.assert_allclose(out.numpy()[q_ptr[b] + i], want_out, atol=2e-6)
            np.testing.assert_allclose(lse.numpy()[q_ptr[b] + i], want_lse, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize(("h_kv", "h_q", "d"), PREFILL_HEADS)
def test_prefill_paged_matches_numpy(target, causal, h_kv, h_q, d, lanes):
    rng = np.random.default_rng(2)
    q_lens, kv_lens = [3, 20, 1], [35, 20, 0]  # the last sequence has nothing cached yet
    pool, indptr, values, last, rows = _paged(rng, kv_lens, h_kv, d)
    q = rng.standard_normal((sum(q_lens), h_q, d)).astype("float32")
    q_ptr = np.cumsum([0, *q_lens])
    out, lse = _t(np.zeros(q.shape), "float32"), _t(np.zeros(q.shape[:2]), "float32")
    kernel = _build(ap.prefill_paged(h_kv, h_q, d, "float32", PAGE, lanes=lanes), target)
    sm = d**-0.5
    kernel(_t(q, "float32"), _t(q_ptr), _t(pool, "float32"), _t(indptr), _t(values), _t(last),
           _t(np.zeros(3)), _t(np.zeros(len(q))), out, lse, causal, 0, 1.0, 1e4, sm)  # fmt: skip
    for b in range(3):
        for i in range(q_lens[b]):
            visible = kv_lens[b] - q_lens[b] + i + 1 if causal else kv_lens[b]
            want_out, want_lse = _attend(q[q_ptr[b] + i], *rows[b], max(0, visible))
            np.testing.assert_allclose(out.numpy()[q_ptr[b] + i], want_out, atol=2e-6)
            np.testing.assert_allclose(lse.numpy()[q_ptr[b] + i], want_lse, rtol=1e-6, atol=1e-5)


def _prefill_last_rows(kernel, q, pool, indptr, values, last, chunks, sm):
    """Each of `chunks` ((sequence, m): its last m rows as new rows) through one call of the
    paged kernel; the output and lse bits of each."""
    q_rows = np.concatenate([q[b][len(q[b]) - m :] for b, m in chunks])
    q_ptr = np.cumsum([0] + [m for _, m in chunks])
    q_pos = np.concatenate([np.arange(len(q[b]) - m, len(q[b])) for b, m in chunks])
    pick = [b for b, _ in chunks]
    page_ptr = np.cumsum([0] + [indptr[b + 1] - indptr[b] for b in pick])
    page_ids = np.concatenate([values[indptr[b] : indptr[b + 1]] for b in pick])
    h_q, d = q_rows.shape[1:]
    out = _t(np.zeros(q_rows.shape), "float32")
    lse = _t(np.zeros(q_rows.shape[:2]), "float32")
    kernel(_t(q_rows, "float32"), _t(q_ptr), _t(pool, "float32"), _t(page_ptr), _t(page_ids),
           _t([last[b] for b in pick]), _t(np.zeros(len(pick))), _t(q_pos), out, lse, 1, 0,
           1.0, 1e4, sm)  # fmt: skip
    bits = out.numpy().view(np.uint32), lse.numpy().view(np.uint32)
    return [(bits[0][a:z], bits[1][a:z]) for a, z in zip(q_ptr[:-1], q_ptr[1:], strict=True)]


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_rows_do_not_depend_on_their_block(target, window):
    """`--deterministic` prefills a prompt in chunks on a fixed grid: a query row's output and
    lse are the same bits whether its chunk is the whole prompt or its last rows (other
    block-mates, another place in the block), with the earlier rows' keys in the cache, and
    whatever other sequences share the call (a short one, which takes the row kernel, or a
    long one). With a sliding window (a layer passes its scale negated) also against numpy:
    a row at position p sees keys p - 6 .. p."""
    h_kv, h_q, d, lengths = 2, 6, 64, [45, 13]
    rng = np.random.default_rng(3)
    pool, indptr, values, last, rows = _paged(rng, lengths, h_kv, d)
    q = [rng.standard_normal((n, h_q, d)).astype("float32") for n in lengths]
    kernel = _build(ap.prefill_paged(h_kv, h_q, d, "float32", PAGE, window, lanes=16), target)
    sm = -(d**-0.5) if window else d**-0.5
    args = (kernel, q, pool, indptr, values, last)
    (whole,) = _prefill_last_rows(*args, [(0, 45)], sm)
    for m in (29, 10, ap.few_rows(16)):  # chunks of the blocked path
        (part,) = _prefill_last_rows(*args, [(0, m)], sm)
        for got, want in zip(part, whole, strict=True):
            np.testing.assert_array_equal(got, want[45 - m :])
    # a short chunk (the row kernel) and a long one, alone and side by side, in either order
    few = ap.few_rows(16) - 1
    (short,) = _prefill_last_rows(*args, [(1, few)], sm)
    (long_,) = _prefill_last_rows(*args, [(0, 29)], sm)
    for chunks in ([(1, few), (0, 29)], [(0, 29), (1, few)]):
        got = dict(zip([b for b, _ in chunks], _prefill_last_rows(*args, chunks, sm), strict=True))
        for a, b in zip(got[1] + got[0], short + long_, strict=True):
            np.testing.assert_array_equal(a, b)
    if window:
        k, v = rows[0]
        out = whole[0].view(np.float32)
        for p in range(45):
            lo = max(0, p - window + 1)
            want, _ = _attend(q[0][p], k[lo : p + 1], v[lo : p + 1], p + 1 - lo)
            np.testing.assert_allclose(out[p], want, atol=2e-6)


def test_vector_lanes_follow_the_target():
    def lanes(cpu, d):
        return vector_lanes(tvm.target.Target({"kind": "llvm", "mcpu": cpu}), d)

    assert lanes("haswell", 64) == 8 and lanes("znver3", 64) == 8
    assert lanes("znver4", 64) == 16 and lanes("skylake-avx512", 256) == 16
    assert lanes("znver4", 72) == 8  # head_dim not a multiple of 16
