"""The mask path of the step sampler, against numpy: masked rows never sample a disallowed
token, go to the host while the others stay on the device, and their logprobs are over the
masked distribution. Fake data only: every test takes milliseconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from tallow.runtime.constraint import (
    masks_to_bool,
)
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.sampler import log_softmax, make_generator
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.step_sampling import StepSampler

VOCAB = 320  # logits width; the tiny tokenizer has 312 tokens, so 8 are padding


def random_masks(rng, rows: int, width: int, density: float) -> np.ndarray:
    allowed = rng.random((rows, width)) < density
    allowed[np.arange(rows), rng.integers(0, width, rows)] = True  # never empty
    words = -(-width // 32)
    bits = np.zeros((rows, words * 32), dtype=np.uint8)
    bits[:, :width] = allowed
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    np.testing.assert_array_equal(masks_to_bool(packed, width), allowed)
    return packed


@pytest.mark.parametrize("device", [True, False])
def test_step_sampler_masked_rows_never_sample_disallowed(device):
    rng = np.random.default_rng(0)
    runner = FakeModelRunner(vocab_size=VOCAB, device_sampling=device)
    sampler = StepSampler(runner)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=2),
        SamplingParams(temperature=1.5, min_p=0.05, seed=3, logprobs=True, top_logprobs=5),
    ]
    for trial in range(30):
        rows = 8
        logits = (rng.standard_normal((rows, VOCAB)) * 3).astype(np.float32)
        runner._last_logits = logits
        params = [kinds[(trial + r) % 4] for r in range(rows)]
        masks = random_masks(rng, rows, VOCAB, density=[0.002, 0.05, 0.5][trial % 3])
        use = [masks[r] if r % 2 == 0 else None for r in range(rows)]  # odd rows unconstrained
        gens = [make_generator(trial * 100 + r) for r in range(rows)]
        before = logits.copy()
        out = sampler.sample(logits, list(range(rows)), params, gens, [()] * rows, [()] * rows, use)
        np.testing.assert_array_equal(logits, before)  # the forward's logits are not edited
        allowed = masks_to_bool(masks, VOCAB)
        for r in range(0, rows, 2):
            assert allowed[r, out.token_ids[r]], (trial, r)
        # unconstrained rows: exactly what they draw without any masks around
        gens2 = [make_generator(trial * 100 + r) for r in range(rows)]
        ref = StepSampler(runner).sample(
            logits, list(range(rows)), params, gens2, [()] * rows, [()] * rows
        )
        for r in range(1, rows, 2):
            assert out.token_ids[r] == ref.token_ids[r]
            assert out.logprobs[r] == ref.logprobs[r]


def test_masked_rows_go_to_host_others_stay_on_device():
    runner = FakeModelRunner(vocab_size=VOCAB)
    sampler = StepSampler(runner)
    logits = np.random.default_rng(1).standard_normal((4, VOCAB)).astype(np.float32)
    runner._last_logits = logits
    masks = random_masks(np.random.default_rng(2), 4, VOCAB, 0.1)
    p = SamplingParams(temperature=0.0)
    sampler.sample(
        logits, [0, 1, 2, 3], [p] * 4, [None] * 4, [()] * 4, [()] * 4, [masks[0]] + [None] * 3
    )
    assert (sampler.device_rows, sampler.host_rows) == (3, 1)


def test_logprobs_are_over_the_masked_distribution():
    runner = FakeModelRunner(vocab_size=VOCAB, device_sampling=False)
    logits = np.random.default_rng(3).standard_normal((1, VOCAB)).astype(np.float32) * 3
    masks = random_masks(np.random.default_rng(4), 1, VOCAB, 0.02)
    allowed = masks_to_bool(masks, VOCAB)[0]
    p = SamplingParams(temperature=1.0, seed=5, logprobs=True, top_logprobs=20)
    out = StepSampler(runner).sample(logits, [0], [p], [make_generator(5)], [()], [()], [masks[0]])
    ref = log_softmax(np.where(allowed, logits, -np.inf).astype(np.float32))[0]
    tok = int(out.token_ids[0])
    assert allowed[tok]
    assert out.logprobs[0] == pytest.approx(float(ref[tok]), abs=1e-5)
    tops = out.top_logprobs[0]
    assert len(tops) == min(20, allowed.sum())  # disallowed tokens are not alternatives
    assert all(allowed[t] and np.isfinite(lp) for t, lp in tops)
    assert sum(np.exp(lp) for t, lp in tops) <= 1.0 + 1e-5


def test_sampler_greedy_masked_picks_best_allowed():
    logits = np.random.default_rng(6).standard_normal((2, VOCAB)).astype(np.float32)
    masks = random_masks(np.random.default_rng(7), 2, VOCAB, 0.1)
    runner = FakeModelRunner(vocab_size=VOCAB)
    runner._last_logits = logits
    out = StepSampler(runner).sample(
        logits, [0, 1], [SamplingParams(temperature=0.0)] * 2, [None] * 2, [()] * 2, [()] * 2, masks
    )
    allowed = masks_to_bool(masks, VOCAB)
    expect = np.argmax(np.where(allowed, logits, -np.inf), axis=1)
    np.testing.assert_array_equal(out.token_ids, expect)
