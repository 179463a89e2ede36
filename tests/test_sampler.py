"""Sampler against independent oracles: torch log-softmax, transformers' logits processors, a
plain full-sort reference distribution written here, and seeded batch-invariance."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tallow.runtime.sampler import Sampler, make_generator, warp_logits
from tallow.runtime.sampling_params import SamplingParams

V = 500


def _logits(batch: int, seed: int = 0, vocab: int = V) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((batch, vocab)) * 3).astype(np.float32)


def _hf_warp(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """transformers' warpers in `generate`'s order: temperature, top-k, top-p, min-p."""
    scores = torch.from_numpy(row.copy())[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores[0].numpy()


def _reference_probs(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Textbook version with a full sort: the distribution a sampled token should follow."""
    y = row.astype(np.float64) / p.temperature
    keep = np.ones_like(y, dtype=bool)
    order = np.argsort(-y, kind="stable")
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    probs = np.where(keep, np.exp(y - y.max()), 0.0)
    probs /= probs.sum()
    if p.top_p < 1.0:
        before = np.cumsum(probs[order]) - probs[order]  # mass strictly ahead of each token
        keep[order[before >= p.top_p]] = False
    probs = np.where(keep, probs, 0.0)
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs.max()
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


WARP_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=10),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=2.0, top_p=0.999),  # needs the top-p window to widen
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=V),  # top-k as wide as the vocab: no cut
    SamplingParams(temperature=0.5, top_k=3, top_p=0.01),
]


def test_surviving_tokens_match_transformers_warpers():
    x = _logits(len(WARP_CASES) * 4, seed=1)
    params = WARP_CASES * 4
    ours = warp_logits(x, params)
    for i, p in enumerate(params):
        hf = _hf_warp(x[i], p)
        np.testing.assert_array_equal(np.isfinite(ours[i]), np.isfinite(hf), err_msg=str(p))
        kept = np.isfinite(hf)
        np.testing.assert_allclose(ours[i][kept], hf[kept], rtol=1e-6)


def test_warp_is_independent_of_batch_mix():
    x = _logits(len(WARP_CASES), seed=2)
    full = warp_logits(x, WARP_CASES)
    for i, p in enumerate(WARP_CASES):
        np.testing.assert_array_equal(warp_logits(x[i : i + 1], [p])[0], full[i])


@pytest.mark.parametrize("p", WARP_CASES[:7], ids=lambda p: f"T{p.temperature}k{p.top_k}")
def test_sampled_frequencies_follow_reference_distribution(p):
    vocab = 40
    row = _logits(1, seed=3, vocab=vocab)[0]
    ref = _reference_probs(row, p)
    n, rows = 20000, 500
    gens = [make_generator(123)] * rows  # one stream shared by all rows: n draws in sequence
    sampler = Sampler()
    batch = np.repeat(row[None], rows, axis=0)
    counts = np.zeros(vocab)
    for _ in range(n // rows):
        counts += np.bincount(sampler.sample(batch, [p] * rows, gens).token_ids, minlength=vocab)
    freq = counts / n
    assert counts[ref == 0].sum() == 0  # never a cut token
    # Binomial standard error per token; 5 sigma plus a small floor.
    tol = 5 * np.sqrt(ref * (1 - ref) / n) + 1e-3
    assert np.all(np.abs(freq - ref) <= tol), np.abs(freq - ref).max()


@pytest.mark.parametrize("vocab", [1024, 2500, 3 * 1024 + 1])
def test_draw_across_cdf_blocks(vocab):
    # Vocabularies spanning several blocks of the two-level CDF, mass in every block, a cut
    # leaving survivors in different blocks.
    row = _logits(1, seed=9, vocab=vocab)[0] * 0.3
    for p in [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=7)]:
        ref = _reference_probs(row, p)
        n, rows = 10000, 1000
        gens = [make_generator(5)] * rows
        batch = np.repeat(row[None], rows, axis=0)
        counts = np.zeros(vocab)
        for _ in range(n // rows):
            got = Sampler().sample(batch, [p] * rows, gens).token_ids
            counts += np.bincount(got, minlength=vocab)
        assert counts[ref == 0].sum() == 0
        # Compare mass per 256-token bin (and per token when the cut leaves few tokens).
        bins = np.arange(0, vocab, 256)
        freq_b, ref_b = np.add.reduceat(counts / n, bins), np.add.reduceat(ref, bins)
        assert np.all(np.abs(freq_b - ref_b) <= 5 * np.sqrt(ref_b * (1 - ref_b) / n) + 1e-3)
        if p.top_k:
            tol = 5 * np.sqrt(ref * (1 - ref) / n) + 1e-3
            assert np.all(np.abs(counts / n - ref) <= tol)


def test_greedy_is_argmax_and_needs_no_generator():
    x = _logits(8, seed=4)
    out = Sampler().sample(x, [SamplingParams(temperature=0.0)] * 8, [None] * 8)
    np.testing.assert_array_equal(out.token_ids, np.argmax(x, axis=1))
    assert out.logprobs == [None] * 8


@pytest.mark.parametrize("temp", [5e-324, 1e-40, 1e-300])
def test_vanishing_temperature_samples_the_argmax_quietly(temp):
    """Valid (positive) temperatures that divide the logits past float range, as the fuzz
    campaign sends them: the draw is the argmax (the limit as temperature -> 0), whatever
    the seed, and numpy's overflow warnings do not reach the server's log."""
    x = _logits(4, seed=11)
    params = [SamplingParams(temperature=temp, top_p=0.9)] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(3):
            gens = [make_generator(seed + i) for i in range(4)]
            out = Sampler().sample(x, params, gens)
            np.testing.assert_array_equal(out.token_ids, np.argmax(x, axis=1))


def test_sampled_row_without_generator_is_an_error():
    with pytest.raises(ValueError, match="generator"):
        Sampler().sample(_logits(1), [SamplingParams()], [None])


def test_seeded_rows_reproduce_whatever_the_batch_companions():
    sampler = Sampler()
    mine = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=7)
    steps = [_logits(1, seed=100 + s)[0] for s in range(30)]

    def run(companions: list[SamplingParams], position: int) -> list[int]:
        gens = [make_generator(p.seed) for p in companions]
        gens.insert(position, make_generator(mine.seed))
        params = list(companions)
        params.insert(position, mine)
        got = []
        for s, row in enumerate(steps):
            x = _logits(len(params), seed=900 + s)
            x[position] = row
            got.append(int(sampler.sample(x, params, gens).token_ids[position]))
        return got

    alone = run([], 0)
    mixed = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, seed=None),
        SamplingParams(temperature=1.0, top_k=2, seed=3),
        SamplingParams(temperature=0.3, min_p=0.1, top_p=0.5),
    ]
    assert run(mixed, 2) == alone
    assert run(mixed[:1], 1) == alone
    assert run(mixed * 3, 5) == alone
    assert len(set(alone)) > 3  # actually sampling, not stuck on one token


def test_different_and_missing_seeds_differ():
    x = np.zeros((1, V), dtype=np.float32)  # uniform: any stream difference shows
    p = SamplingParams(temperature=1.0)

    def draws(gen):
        return [int(Sampler().sample(x, [p], [gen]).token_ids[0]) for _ in range(20)]

    assert draws(make_generator(1)) == draws(make_generator(1))
    assert draws(make_generator(1)) != draws(make_generator(2))
    assert draws(make_generator(None)) != draws(make_generator(None))
    assert draws(make_generator(-5)) == draws(make_generator(-5))


def test_logprobs_are_log_softmax_after_penalties_and_bias():
    x = _logits(3, seed=5)
    prompt = [[1, 2, 3], [], [7]]
    output = [[3, 3, 4], [9, 9, 9, 10], []]
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5, repetition_penalty=1.3),
        SamplingParams(
            temperature=0.6,
            top_k=5,
            logprobs=True,
            top_logprobs=20,
            frequency_penalty=0.5,
            presence_penalty=0.25,
            logit_bias={11: 2.0, 12: -100.0},
        ),
        SamplingParams(temperature=1.0, top_p=0.3, logprobs=True),
    ]
    gens = [None, make_generator(0), make_generator(1)]
    out = Sampler().sample(x, params, gens, prompt, output)

    # Independent reference: transformers' repetition penalty, OpenAI's formula, torch.
    t = torch.from_numpy(x.copy())
    t[0:1] = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt[0] + output[0]]), t[0:1])
    for tok in set(output[1]):
        t[1, tok] -= 0.5 * output[1].count(tok) + 0.25
    t[1, 11] += 2.0
    t[1, 12] -= 100.0
    ref = torch.log_softmax(t, dim=-1).numpy()

    for i in range(3):
        tok = int(out.token_ids[i])
        assert out.logprobs[i] == pytest.approx(float(ref[i, tok]), abs=1e-5)
    assert out.top_logprobs[2] is None
    for i, n in [(0, 5), (1, 20)]:
        vals, idx = torch.topk(torch.from_numpy(ref[i]), n)
        assert [tid for tid, _ in out.top_logprobs[i]] == idx.tolist()
        np.testing.assert_allclose([lp for _, lp in out.top_logprobs[i]], vals, atol=1e-5)
    assert out.token_ids[0] == int(np.argmax(ref[0]))


def test_logprobs_ignore_temperature_and_truncation_but_see_bias():
    # The documented choice: log-softmax after bias/penalties, before temperature and cuts.
    x = np.zeros((2, 10), dtype=np.float32)
    params = [
        SamplingParams(temperature=0.25, top_k=1, logit_bias={3: 1.0}, logprobs=True),
        SamplingParams(temperature=0.0, logit_bias={3: 1.0}, logprobs=True),
    ]
    out = Sampler().sample(x, params, [make_generator(0), None])
    want = 1.0 - np.log(np.e + 9)  # not log(1) (after top-k) nor log(1/10) (raw model)
    assert out.token_ids.tolist() == [3, 3]
    assert out.logprobs == [pytest.approx(want, abs=1e-6)] * 2


def test_repetition_penalty_matches_transformers():
    x = _logits(1, seed=6)
    x[0, :6] = [2.0, -2.0, 0.0, 5.0, -0.5, 1.0]
    seen = [0, 1, 2, 3, 4, 0, 0]
    for pen in (0.7, 1.0, 1.8):
        p = SamplingParams(temperature=0.0, repetition_penalty=pen, logprobs=True, top_logprobs=20)
        out = Sampler().sample(x, [p], [None], [seen[:3]], [seen[3:]])
        hf = RepetitionPenaltyLogitsProcessor(pen)(torch.tensor([seen]), torch.from_numpy(x.copy()))
        ref = torch.log_softmax(hf, dim=-1)[0].numpy()
        for tid, lp in out.top_logprobs[0]:
            assert lp == pytest.approx(float(ref[tid]), abs=1e-5)
        assert out.token_ids[0] == int(np.argmax(ref))


@pytest.mark.parametrize("pen", [5e-324, 1e-40, 1e300])
def test_extreme_repetition_penalties_keep_the_distribution_finite(pen):
    """Valid (positive) but past float32: 5e-324 is 0 there, 1e-40 divides a logit past its
    range. The seen token with the largest positive logit must win (tiny penalties favour
    seen tokens), with finite logprobs; an enormous one pushes seen tokens out."""
    x = _logits(1, seed=7)
    x[0, :4] = [3.0, 1.0, -2.0, 0.5]
    p = SamplingParams(temperature=0.0, repetition_penalty=pen, logprobs=True, top_logprobs=3)
    out = Sampler().sample(x, [p], [None], [[0, 1, 2]], [[]])
    assert all(np.isfinite(lp) for _, lp in out.top_logprobs[0])
    if pen < 1:
        assert out.token_ids[0] in (0, 1)
    else:
        assert out.token_ids[0] not in (0, 1, 2)


def test_frequency_and_presence_penalties_use_output_tokens_only():
    x = np.zeros((1, 10), dtype=np.float32)
    p = SamplingParams(
        temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5, top_logprobs=10
    )
    out = Sampler().sample(x, [p], [None], prompt_ids=[[5, 5, 5]], output_ids=[[1, 1, 2]])
    lp = dict(out.top_logprobs[0])
    shift = {i: lp[i] - lp[0] for i in range(10)}
    assert shift[1] == pytest.approx(-2.5)  # 2 * 1.0 + 0.5
    assert shift[2] == pytest.approx(-1.5)  # 1 * 1.0 + 0.5
    assert shift[5] == pytest.approx(0.0)  # prompt tokens are not frequency-penalised
    # A negative frequency penalty encourages repeats.
    p.frequency_penalty, p.presence_penalty = -2.0, 0.0
    out = Sampler().sample(x, [p], [None], output_ids=[[7]], prompt_ids=[[]])
    assert out.token_ids[0] == 7


def test_logit_bias_forces_and_bans_tokens():
    x = _logits(2, seed=7)
    banned = int(np.argmax(x[0]))
    params = [
        SamplingParams(temperature=0.0, logit_bias={banned: -100.0}),
        SamplingParams(temperature=1.0, logit_bias={42: 100.0}, seed=0),
    ]
    out = Sampler().sample(x, params, [None, make_generator(0)])
    assert out.token_ids[0] == int(np.argsort(-x[0])[1])
    assert out.token_ids[1] == 42


def test_top_k_does_not_sort_the_vocabulary(monkeypatch):
    # Plain temperature sampling and top-k must not fall back to a full sort.
    calls = []
    real_sort = np.sort

    def spy(a, *args, **kwargs):
        calls.append(np.shape(a))
        return real_sort(a, *args, **kwargs)

    monkeypatch.setattr(np, "sort", spy)
    x = _logits(4, seed=8, vocab=5000)
    ps = [SamplingParams(top_k=20), SamplingParams(), SamplingParams(top_p=0.5, top_k=30)] * 2
    Sampler().sample(x[:1].repeat(6, 0), ps, [make_generator(i) for i in range(6)])
    assert all(shape[-1] < 5000 for shape in calls), calls
