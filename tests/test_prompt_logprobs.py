"""Prompt logprobs in the engine, on the fake runner: every prompt token scored against a
numpy log-softmax of the logits a sequence holding exactly that prefix gives (the fake's
`reference_logits`), across chunked prefill, preemption, prefix-cache hits, n > 1 and
max_tokens 0. No TVM; milliseconds each."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_fake import V, greedy, make_engine, oracle, prompt, tokens_of

from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.sampling_params import SamplingParams, SamplingParamsError


def expected_scores(tokens: list[int], top: int) -> list:
    """(token, logprob, top ids) per prompt token from position 1, by numpy in float64."""
    ref = FakeModelRunner(vocab_size=V)
    out = []
    for i in range(1, len(tokens)):
        x = ref.reference_logits(tokens[:i]).astype(np.float64)
        lp = x - np.log(np.exp(x - x.max()).sum()) - x.max()
        best = [int(t) for t in np.argsort(-lp, kind="stable")[:top]]
        out.append((tokens[i], lp[tokens[i]], best, lp[best]))
    return out


def check(scores, tokens: list[int], top: int) -> None:
    assert len(scores) == len(tokens)
    assert scores[0] is None  # nothing predicts the first token
    for got, (token, lp, best, best_lp) in zip(
        scores[1:], expected_scores(tokens, top), strict=True
    ):
        assert got.token_id == token
        assert got.logprob == pytest.approx(lp, abs=1e-5)
        assert [t for t, _ in got.top_logprobs or []] == best
        assert [v for _, v in got.top_logprobs or []] == pytest.approx(best_lp, abs=1e-5)


def prompt_scores(outs) -> list:
    given = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(given) == 1, "prompt logprobs come once, with one output"
    assert outs[0].prompt_logprobs is not None, "...the request's first"
    return given[0]


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_prompt_scores_match_the_logits_at_every_position(chunk):
    engine = make_engine(prefill_chunk_size=chunk, max_num_batched_tokens=max(chunk, 8))
    p = prompt(37)
    (outs,) = engine.generate([p], greedy(5, prompt_logprobs=3))
    check(prompt_scores(outs), p, 3)
    assert tokens_of(outs) == oracle(p, 5)  # generation is unchanged by the scoring
    assert engine.runner.num_free_pages() + engine.stats().kv_pages_used == 128


def test_max_tokens_zero_scores_and_generates_nothing():
    engine = make_engine()
    p = prompt(20, 3)
    (outs,) = engine.generate([p], greedy(0, prompt_logprobs=0))
    check(prompt_scores(outs), p, 0)
    assert outs[-1].finished and outs[-1].outputs[-1].finish_reason == "length"
    assert tokens_of(outs) == [] and outs[-1].usage.completion_tokens == 0
    # the top-0 form: just the tokens' own logprobs
    assert all(s.top_logprobs is None for s in prompt_scores(outs)[1:])
    # then an ordinary request still works
    (outs,) = engine.generate([p], greedy(3))
    assert tokens_of(outs) == oracle(p, 3) and all(o.prompt_logprobs is None for o in outs)


def test_scoring_ignores_a_prefix_cache_hit_and_mixes_with_other_requests():
    engine = make_engine(prefill_chunk_size=8, max_num_batched_tokens=24)
    p = prompt(30)
    engine.generate([p], greedy(2))  # p's KV is now a prefix-cache entry
    hits = engine.stats().prefix_cache_hit_tokens
    others = [prompt(12, 5), prompt(25, 9)]
    results = engine.generate(
        [others[0], p, others[1]], [greedy(4), greedy(4, prompt_logprobs=2), greedy(4)]
    )
    check(prompt_scores(results[1]), p, 2)
    assert engine.stats().prefix_cache_hit_tokens == hits  # the scored prompt was recomputed
    for outs, q in zip(results, [others[0], p, others[1]], strict=True):
        assert tokens_of(outs) == oracle(q, 4)


def test_preemption_mid_prompt_restarts_the_scores():
    # 16 pages of 4 tokens: two 24-token prompts growing by 20 tokens cannot both fit.
    engine = make_engine(
        num_pages=16, prefix=False, prefill_chunk_size=8, max_num_batched_tokens=16
    )
    a, b = prompt(24, 2), prompt(24, 11)
    results = engine.generate(
        [a, b], [greedy(20, ignore_eos=True, prompt_logprobs=1), greedy(20, prompt_logprobs=1)]
    )
    assert engine.stats().num_preemptions > 0
    for outs, q in zip(results, [a, b], strict=True):
        check(prompt_scores(outs), q, 1)
        assert tokens_of(outs) == oracle(q, 20)


def test_n_siblings_share_one_scored_prompt():
    engine = make_engine()
    p = prompt(18)
    (outs,) = engine.generate([p], greedy(3, n=3, prompt_logprobs=1))
    check(prompt_scores(outs), p, 1)
    for i in range(3):
        assert tokens_of(outs, i) == oracle(p, 3)


def test_the_stop_token_that_ends_a_completion_keeps_its_logprob():
    p = prompt(10)
    eos = oracle(p, 3)[2]  # the third greedy token ends it
    engine = make_engine(eos=[eos])
    (outs,) = engine.generate([p], greedy(8, logprobs=True))
    deltas = [d for o in outs for d in o.outputs]
    assert tokens_of(outs) == oracle(p, 2) and deltas[-1].finish_reason == "stop"
    stop = deltas[-1].stop_logprob
    assert stop is not None and stop.token_id == eos
    x = FakeModelRunner(vocab_size=V).reference_logits(p + oracle(p, 2)).astype(np.float64)
    assert stop.logprob == pytest.approx(x[eos] - np.log(np.exp(x).sum()), abs=1e-5)
    # without logprobs nothing is reported
    (outs,) = make_engine(eos=[eos]).generate([p], greedy(8))
    assert all(d.stop_logprob is None for o in outs for d in o.outputs)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 1, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"max_tokens": 1, "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"max_tokens": 1, "priority": 2**31}, "priority"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(SamplingParamsError, match=f"^{field}:"):
        SamplingParams(**kw).validate(V)
