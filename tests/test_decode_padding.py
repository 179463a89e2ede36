"""Decode batches rounded up to the CUDA-graph buckets (`runtime/decode_padding.py`).

The rounding is target-independent, so it is checked on a CPU artifact forced to pad: the real
rows' logits must be bit-identical to an unpadded runner's (attention never mixes sequences,
and a decode row's matmuls do not depend on the other rows), the scratch sequences must give
their page back after every step, and the pages the runner reports free must not move.
"""

from __future__ import annotations

import numpy as np
import pytest

from tallow.runtime.decode_padding import SCRATCH_SEQ_BASE, DecodePadding

CUDA_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # compiler/backends/cuda.py CUDA_GRAPH_BATCH_BUCKETS


class _Cache:
    """Sequence lengths, as the paged KV cache keeps them (popn below zero is an error)."""

    def __init__(self):
        self.lengths: dict[int, int] = {}

    def add(self, seq_id):
        assert seq_id not in self.lengths, "sequence added twice"
        self.lengths[seq_id] = 0

    def popn(self, seq_id, n):
        assert self.lengths[seq_id] >= n
        self.lengths[seq_id] -= n


def test_buckets_and_scratch_sequences():
    cache = _Cache()
    pad = DecodePadding(CUDA_BUCKETS, cache.add, cache.popn)
    assert [pad.bucket(n) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert pad.bucket(65) == 65  # above the largest bucket: as is (the runner caps its batch)
    assert [pad.slots_for(m) for m in (1, 2, 5, 8, 64)] == [0, 0, 3, 3, 31]  # 33 runs as 64
    items = [(7, [11]), (3, [12]), (9, [13])]
    padded = pad.pad(items)
    assert padded[:3] == items and [s for s, _ in padded[3:]] == [SCRATCH_SEQ_BASE]
    assert len(pad.pad([(i, [1]) for i in range(17)])) == 32
    assert sorted(cache.lengths) == [SCRATCH_SEQ_BASE + i for i in range(15)]  # added once
    for seq_id, _ in padded[3:]:
        cache.lengths[seq_id] += 1  # what begin_forward does
    pad.rewind(len(padded) - 3)
    assert set(cache.lengths.values()) == {0}
    with pytest.raises(ValueError, match="positive"):
        DecodePadding([0, 4], cache.add, cache.popn)


def test_padded_decode_matches_unpadded(tiny_artifact):
    """Two runners on one CPU artifact, one rounding batch_decode steps up to the CUDA
    buckets: 3, 5 and 2 sequences decode (run as 4, 8 and 2 rows)."""
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    folder = tiny_artifact("qwen3", "f32")
    kv = KVCacheConfig(max_batch_size=8, max_total_tokens=512)
    plain = TVMModelRunner(folder, kv=kv)
    padded = TVMModelRunner(folder, kv=kv, decode_buckets=CUDA_BUCKETS)
    assert plain.decode_padding is None and padded.num_pages == plain.num_pages
    rng = np.random.default_rng(0)
    vocab = plain.vocab_size
    prompts = {s: rng.integers(0, vocab, 3 + s).tolist() for s in range(5)}
    for runner in (plain, padded):
        for s, prompt in prompts.items():
            runner.add_sequence(s)
            runner.forward([(s, prompt)])
    for step, live in enumerate(([0, 1, 2], [0, 1, 2, 3, 4], [3, 4], [0, 1, 2, 3, 4])):
        items = [(s, [int(rng.integers(0, vocab))]) for s in live]
        want = np.array(plain.forward(items), copy=True)
        got = np.array(padded.forward(items), copy=True)
        assert got.shape == (len(live), vocab)
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        assert padded.num_free_pages() == plain.num_free_pages()
    scratch = padded.decode_padding.scratch
    assert len(scratch) == 3  # 5 sequences ran as 8: three slots, added once
    for seq_id in scratch:  # each is empty again (TVM refuses to pop an empty sequence)
        with pytest.raises(Exception, match="only has length 0"):
            padded.popn(seq_id, 1)


def test_bucket_functions_dispatch():
    """A library's static-row decodes are called for their buckets only; other buckets, and
    libraries without them, keep the symbolic `batch_decode`."""
    from tallow.runtime.decode_padding import decode_padding_for

    cache = _Cache()
    details = {"static_decode_functions": {"2": "batch_decode_b2", "8": "batch_decode_b8"}}
    graph = {"batch_buckets": list(CUDA_BUCKETS)}
    pad = decode_padding_for(details, graph, None, cache.add, cache.popn)
    assert pad.buckets == CUDA_BUCKETS
    assert [pad.function(pad.bucket(n)) for n in (2, 3, 5, 8)] == [
        "batch_decode_b2",
        "batch_decode",  # no b4 in this library
        "batch_decode_b8",
        "batch_decode_b8",
    ]
    assert decode_padding_for(details, {}, None, cache.add, cache.popn) is None  # CPU: none
    forced = decode_padding_for({}, {}, (1, 4), cache.add, cache.popn)
    assert forced.buckets == (1, 4) and forced.function(4) == "batch_decode"
    # a function for a size that is not a bucket is never called
    odd = decode_padding_for(
        {"static_decode_functions": {"3": "batch_decode_b3"}}, graph, None, cache.add, cache.popn
    )
    assert odd.functions == {}


@pytest.mark.slow
def test_static_bucket_decodes_match_symbolic(tiny_model_dir, tmp_path):
    """A CPU artifact built with static-row decodes for buckets 2 and 4 (an internal compile
    option; CUDA libraries get them for every bucket): padded steps call their bucket's
    function (a step of 5 rows, bucket 8, has none: the symbolic `batch_decode`), and the real
    rows' logits match the symbolic `batch_decode` of an unpadded runner.
    Slow (a compile of its own: 25-110 s on 2 busy cores)."""
    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    opts = CompileOptions(
        model=str(tiny_model_dir("qwen3")), output=tmp_path, quiet=True, decode_buckets=(2, 4)
    )
    folder = compile_model(opts)
    kv = KVCacheConfig(max_batch_size=8, max_total_tokens=512)
    plain = TVMModelRunner(folder, kv=kv)
    padded = TVMModelRunner(folder, kv=kv, decode_buckets=CUDA_BUCKETS)
    assert plain.decode_padding is None
    assert padded.decode_padding.functions == {r: f"batch_decode_b{r}" for r in (2, 4)}
    calls = []
    for rows in (2, 4, 8):  # count the calls each decode function gets
        name = f"batch_decode_b{rows}" if rows < 8 else "batch_decode"
        inner = padded._funcs[name]
        padded._funcs[name] = lambda *a, _f=inner, _n=name: calls.append(_n) or _f(*a)
    rng = np.random.default_rng(1)
    vocab = plain.vocab_size
    prompts = {s: rng.integers(0, vocab, 4 + s).tolist() for s in range(5)}
    for runner in (plain, padded):
        for s, prompt in prompts.items():
            runner.add_sequence(s)
            runner.forward([(s, prompt)])
    for live in ([0, 1, 2], [0, 1, 2, 3, 4], [3, 4], [0, 1, 2, 3, 4]):
        items = [(s, [int(rng.integers(0, vocab))]) for s in live]
        want = np.array(plain.forward(items), copy=True)
        got = np.array(padded.forward(items), copy=True)
        # not bit-identical: a static row count vectorizes the f32 sums in another order
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert calls == ["batch_decode_b4", "batch_decode", "batch_decode_b2", "batch_decode"]
