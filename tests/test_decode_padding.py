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
