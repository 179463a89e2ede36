"""Fault isolation in the engine: what fails for one sequence fails that request alone, and a
failed forward fails its batch but not the engine. Fake runner; milliseconds."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_engine_fake import collect, greedy, make_engine, oracle, prompt, tokens_of

from tallow.runtime.completion_stream import CompletionStream
from tallow.runtime.sampler import Sampler

MARK_SEED = 4242  # the sampler double raises for rows with this seed


class _FaultySampler(Sampler):
    def sample(self, logits, params, generators, prompt_ids, output_ids):
        if any(p.seed == MARK_SEED for p in params):
            raise RuntimeError("sampler exploded for the marked row")
        return super().sample(logits, params, generators, prompt_ids, output_ids)


def _bad(max_tokens: int = 6):
    # logprobs forces the host sampler, which is where the double sits
    return greedy(max_tokens, seed=MARK_SEED, logprobs=True)


def _run(engine, reqs):
    """Submit (prompt, params) pairs at once; each one's outputs, or its error."""

    async def one(p, params):
        try:
            return await collect(engine, p, params)
        except Exception as e:  # noqa: BLE001
            return e

    async def main():
        try:
            return await asyncio.gather(*(one(p, q) for p, q in reqs))
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def _ok(result, p, max_tokens):
    assert not isinstance(result, BaseException), result
    assert tokens_of(result) == oracle(p, max_tokens)
    assert result[-1].finished


def test_sampler_failure_for_one_row_fails_only_that_request():
    engine = make_engine()
    engine.sampling.sampler = _FaultySampler()
    good = [prompt(5, s) for s in (1, 2, 3)]
    bad = prompt(6, 9)
    res = _run(
        engine,
        [(good[0], greedy(8, logprobs=True)), (bad, _bad()), (good[1], greedy(8))]
        + [(good[2], greedy(8, logprobs=True))],
    )
    assert isinstance(res[1], RuntimeError) and "exploded" in str(res[1])
    for i, p in zip((0, 2, 3), good, strict=True):
        _ok(res[i], p, 8)
    assert engine.scheduler.stats().num_running == 0
    assert not engine._requests and not engine._by_seq


def test_stop_handling_failure_fails_only_that_request(monkeypatch):
    accept = CompletionStream.accept

    def faulty(self, token, lp, eos):
        if self.seq.request.params.seed == MARK_SEED and self.seq.num_output_tokens >= 2:
            raise ValueError("detokenizer broke")
        return accept(self, token, lp, eos)

    monkeypatch.setattr(CompletionStream, "accept", faulty)
    engine = make_engine()
    a, b = prompt(5, 1), prompt(7, 4)
    res = _run(engine, [(a, greedy(10)), (b, greedy(10, seed=MARK_SEED))])
    assert isinstance(res[1], ValueError)
    _ok(res[0], a, 10)
    # the engine serves the next request normally
    _ok(_run(engine, [(b, greedy(5))])[0], b, 5)


def test_failed_forward_fails_the_batch_and_the_engine_serves_on():
    engine = make_engine(max_num_seqs=2)
    forward = engine.runner.forward
    calls = {"n": 0}

    def flaky(items):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost its mind once")
        return forward(items)

    engine.runner.forward = flaky
    ps = [prompt(4, s) for s in (1, 2, 3)]
    # max_num_seqs=2: the third request waits and is not part of the failed batch
    res = _run(engine, [(p, greedy(6)) for p in ps])
    assert sum(isinstance(r, RuntimeError) for r in res) == 2
    _ok(res[2], ps[2], 6)
    _ok(_run(engine, [(ps[0], greedy(6))])[0], ps[0], 6)


def test_sync_generate_isolates_a_failing_request():
    engine = make_engine()
    engine.sampling.sampler = _FaultySampler()
    outs: list = []
    bad: list = []
    engine.submit(prompt(5), greedy(4, logprobs=True), outs.append)
    engine.submit(prompt(5, 3), _bad(), bad.append)
    while engine._has_work():
        engine.run_step()
    assert tokens_of(outs) == oracle(prompt(5), 4)
    assert len(bad) == 1 and isinstance(bad[0], RuntimeError)
    with pytest.raises(RuntimeError):
        engine.generate([prompt(3)], _bad())
    assert np.all(np.asarray(tokens_of(engine.generate([prompt(3)], greedy(3))[0])) >= 0)
