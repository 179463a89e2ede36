"""Fair prefill across requests (issue 24, item 4), through the engine on the fake runner:
a short request behind a huge multi-prompt one is prefilled within a bounded number of steps,
both still produce exactly what each produces alone, and the server's queue limit counts
sequences. No timing: everything is counted in engine steps."""

from __future__ import annotations

import asyncio
import math

import pytest

from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server.context import ServerState
from tallow.server.errors import APIError
from tallow.server.jobs import Job
from tallow.server.metrics import ServerMetrics

V = 101
BUDGET, CHUNK, MAX_SEQS = 256, 128, 32
BIG_PROMPTS, BIG_LEN, SMALL_LEN, MAX_TOKENS = 16, 2000, 4, 4


def make_engine() -> Engine:
    runner = FakeModelRunner(
        page_size=16, num_pages=2200, vocab_size=V, context_window=2048, max_batch_size=MAX_SEQS
    )
    config = SchedulerConfig(
        max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET, prefill_chunk_size=CHUNK
    )
    return Engine(runner, scheduler_config=config)


def prompt(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % V for i in range(n)]


BIG = [prompt(BIG_LEN, 10 + p) for p in range(BIG_PROMPTS)]
SMALL = prompt(SMALL_LEN, 3)
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def tokens(outs) -> list[int]:
    return [t for o in outs for d in o.outputs for t in d.token_ids]


def run(big: bool, small_after: int | None, small_group: str | None = None):
    """Submit the big request (16 prompts, one group), run `small_after` steps, submit the
    small one; returns (big outputs per prompt, small outputs, steps until the small one's
    first token counted from its submission, total steps)."""
    engine = make_engine()
    big_sinks: list[list] = [[] for _ in BIG] if big else []
    for i, (p, sink) in enumerate(zip(BIG, big_sinks, strict=False)):
        engine.submit(p, PARAMS, sink.append, request_id=f"big-{i}", group="big")
    small_sink: list = []
    steps, first = 0, None
    while engine._has_work() or (small_after is not None and not small_sink and first is None):
        assert steps < 10_000, "the engine never finished"
        if small_after is not None and steps == small_after:
            engine.submit(SMALL, PARAMS, small_sink.append, request_id="small", group=small_group)
        engine.run_step()
        steps += 1
        if small_after is not None and first is None and tokens(small_sink):
            first = steps - small_after
    return [tokens(s) for s in big_sinks], tokens(small_sink), first, steps


@pytest.fixture(scope="module")
def alone():
    big, _, _, big_steps = run(big=True, small_after=None)
    _, small, small_steps, _ = run(big=False, small_after=0)
    return big, small, big_steps, small_steps


def test_a_short_request_behind_a_huge_one_gets_its_first_token_within_the_bound(alone):
    big_alone, small_alone, big_steps_alone, _ = alone
    big, small, first, steps = run(big=True, small_after=3)
    # Its first step: at most one decode per running sequence comes off the budget first, the
    # rest is shared between the two requests, and each share is capped by the chunk size.
    share = min(CHUNK, (BUDGET - MAX_SEQS) // 2)
    bound = math.ceil(SMALL_LEN / share)
    assert bound == 1
    assert first is not None and first <= bound
    assert small == small_alone and big == big_alone  # fairness changes no output
    assert steps <= big_steps_alone + 1  # the big one is barely delayed and completes
    assert all(len(t) == MAX_TOKENS for t in big)


def test_first_come_first_served_would_have_made_it_wait_for_the_whole_prefill(alone):
    """In the big request's own group (as every request was before: FCFS, head-of-line
    blocking) the small prompt waits behind all 32,000 prompt tokens."""
    _, small_alone, _, _ = alone
    _, small, first, _ = run(big=True, small_after=3, small_group="big")
    assert small == small_alone
    assert first is not None and first >= (BIG_PROMPTS * BIG_LEN) // BUDGET - 10


def test_the_big_request_keeps_its_share_every_step():
    engine = make_engine()
    for i, p in enumerate(BIG):
        engine.submit(p, PARAMS, lambda o: None, request_id=f"big-{i}", group="big")
    engine.run_step()
    for i in range(20):  # a new short request arrives every step
        engine.submit(prompt(SMALL_LEN, 50 + i), PARAMS, lambda o: None, request_id=f"s{i}")
        engine.run_step()
        big_items = [
            sid
            for sid, toks in engine.runner.forward_log[-1]
            if len(toks) > 1 and sid < BIG_PROMPTS
        ]
        assert big_items, "the big request got no prefill this step"


class StubEngine:
    def __init__(self) -> None:
        self.added: list[str] = []

    def add_request(self, ids, params, request_id=None, group=None):
        self.added.append(request_id)

        async def stream():
            return
            yield

        return stream()

    def abort(self, rid):
        pass


def job(engine, state, prompts: int, n: int, limit: int) -> Job:
    metrics = ServerMetrics(lambda: None)
    params = [SamplingParams(max_tokens=2, n=n) for _ in range(prompts)]
    return Job(engine, state, metrics, "completion", "cmpl-", [[1, 2]] * prompts, params, limit)


def test_the_queue_limit_counts_sequences_not_requests():
    state, engine = ServerState(), StubEngine()
    first = job(engine, state, prompts=3, n=2, limit=8)
    assert state.queued == 6  # 3 prompts x n=2
    with pytest.raises(APIError) as e:
        job(engine, state, prompts=2, n=2, limit=8)  # 6 + 4 > 8
    assert e.value.status == 429
    assert state.queued == 6 and len(engine.added) == 3
    second = job(engine, state, prompts=1, n=2, limit=8)  # 6 + 2 = 8: at the limit
    assert state.queued == 8
    first.close()
    second.close()
    assert state.queued == 0
    # An empty queue takes a request larger than the limit, so it is not refused forever.
    big = job(engine, state, prompts=4, n=4, limit=8)
    assert state.queued == 16
    asyncio.run(_drain(big))
    assert state.queued == 0


async def _drain(j: Job) -> None:
    async for _ in j.outputs():
        pass
