"""The engine end to end on the fake runner: streaming, concurrency, preemption, prefix cache,
n > 1, aborts, stop conditions, rejection. No TVM; every run takes milliseconds."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from tallow.runtime.engine import Engine, RequestOutput
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.request import ContextLengthExceededError
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.scheduler import SchedulerConfig

V = 101


def make_engine(num_pages=128, prefix=True, tokenizer=None, eos=(), **cfg) -> Engine:
    runner = FakeModelRunner(page_size=4, num_pages=num_pages, vocab_size=V, context_window=256)
    cfg.setdefault("max_num_batched_tokens", 48)
    cfg.setdefault("prefill_chunk_size", 16)
    cfg.setdefault("max_num_seqs", 8)
    config = SchedulerConfig(enable_prefix_cache=prefix, prefix_cache_max_tokens=256, **cfg)
    return Engine(runner, tokenizer=tokenizer, eos_token_ids=eos, scheduler_config=config)


def oracle(prompt: list[int], max_tokens: int) -> list[int]:
    ref = FakeModelRunner(vocab_size=V)
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(int(np.argmax(ref.reference_logits(toks))))
    return toks[len(prompt) :]


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + 7 * i) % V for i in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def tokens_of(outs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for o in outs for d in o.outputs if d.index == index for t in d.token_ids]


async def collect(engine: Engine, p: list[int], params: SamplingParams) -> list[RequestOutput]:
    return [o async for o in engine.add_request(p, params)]


def word_tokenizer() -> Tokenizer:
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    return tok


def test_stream_matches_oracle_with_usage():
    async def main():
        engine = make_engine()
        outs = await collect(engine, prompt(30), greedy(12))
        await engine.shutdown()
        return engine, outs

    engine, outs = asyncio.run(main())
    assert tokens_of(outs) == oracle(prompt(30), 12)
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)  # streamed one by one
    assert [o.finished for o in outs] == [False] * 11 + [True]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert (outs[-1].usage.prompt_tokens, outs[-1].usage.completion_tokens) == (30, 12)
    st = engine.stats()
    assert (st.prompt_tokens, st.generated_tokens, st.num_running, st.num_waiting) == (
        30,
        12,
        0,
        0,
    )
    assert st.num_steps >= 13 and st.avg_step_latency_s > 0 and st.last_step_latency_s > 0


def _workload() -> list[tuple[list[int], SamplingParams]]:
    work = []
    for i in range(8):
        p = prompt(5 + 9 * i, start=3 * i)
        if i % 2:
            params = SamplingParams(max_tokens=6 + 3 * i, temperature=0.9, top_p=0.9, seed=i)
        else:
            params = greedy(6 + 3 * i, repetition_penalty=1.3 if i == 4 else 1.0)
        work.append((p, params))
    return work


def _run_concurrently(engine: Engine, work) -> list[list[int]]:
    async def main():
        results = await asyncio.gather(*(collect(engine, p, params) for p, params in work))
        await engine.shutdown()
        return [tokens_of(r) for r in results]

    return asyncio.run(main())


def test_eight_concurrent_requests_equal_each_run_alone():
    work = _workload()
    alone = [_run_concurrently(make_engine(prefix=False), [w])[0] for w in work]
    together = _run_concurrently(make_engine(), work)
    assert together == alone
    assert alone[0] == oracle(work[0][0], work[0][1].max_tokens)


def test_preemption_is_transparent():
    work = _workload()
    roomy = make_engine(num_pages=256)
    tight = make_engine(num_pages=36, max_num_batched_tokens=64)
    expected = _run_concurrently(roomy, work)
    got = _run_concurrently(tight, work)
    assert tight.stats().num_preemptions > 0
    assert roomy.stats().num_preemptions == 0
    assert got == expected


def test_prefix_cache_hit_is_reported_and_changes_nothing():
    base = prompt(40, 5)
    follow = base + prompt(10, 77)

    async def main(engine):
        first = await collect(engine, base, greedy(8))
        second = await collect(engine, follow, greedy(8))
        await engine.shutdown()
        return first, second

    cached = make_engine(prefix=True)
    first, second = asyncio.run(main(cached))
    assert first[-1].usage.cached_tokens == 0
    # 40 prompt + 7 fed outputs = 47 tokens cached -> 44 whole pages; follow shares 40 of them.
    assert second[-1].usage.cached_tokens == 40
    assert cached.stats().prefix_cache_hit_tokens == 40
    assert tokens_of(first) == oracle(base, 8)
    assert tokens_of(second) == oracle(follow, 8)
    computed_with_cache = cached.runner.tokens_computed
    uncached = make_engine(prefix=False)
    asyncio.run(main(uncached))
    assert uncached.stats().prefix_cache_hit_tokens == 0
    assert uncached.runner.tokens_computed - computed_with_cache == 40


def test_repeated_prompt_still_prefills_its_last_token():
    engine = make_engine()
    p = prompt(32)  # exactly 8 pages
    a, b = engine.generate([p], greedy(4)), engine.generate([p], greedy(4))
    assert tokens_of(a[0]) == tokens_of(b[0]) == oracle(p, 4)
    assert b[0][-1].usage.cached_tokens == 28  # all but the page holding the last token


def test_n_greater_than_one_prefills_the_prompt_once():
    engine = make_engine(prefix=False)
    p = prompt(30)
    (outs,) = engine.generate([p], greedy(5, n=3))
    runner = engine.runner
    fed = [tok for batch in runner.forward_log for _, toks in batch for tok in toks]
    assert len(fed) == 30 + 3 * 4  # one prompt, then 4 decode tokens per completion
    assert runner.tokens_computed == 42
    for i in range(3):
        assert tokens_of(outs, i) == oracle(p, 5)
    assert outs[-1].finished and outs[-1].usage.completion_tokens == 15
    assert sorted(d.index for d in outs[-1].outputs) == [0, 1, 2]
    assert runner.num_free_pages() == runner.num_pages


def test_n_greater_than_one_samples_independently_and_reproducibly():
    def run():
        engine = make_engine()
        (outs,) = engine.generate([prompt(13)], SamplingParams(max_tokens=12, n=4, seed=5))
        return [tokens_of(outs, i) for i in range(4)]

    first = run()
    assert first == run()
    assert len({tuple(t) for t in first}) == 4


def test_abort_mid_prefill_returns_every_page():
    engine = make_engine(prefill_chunk_size=8, max_num_batched_tokens=8)
    free0 = engine.runner.num_free_pages()
    outs: list = []
    rid = engine.submit(prompt(60), greedy(5), outs.append)
    engine.run_step()
    engine.run_step()
    assert engine.runner.num_free_pages() == free0 - 4  # 16 tokens prefilled
    engine.abort(rid)
    engine.run_step()
    assert engine.runner.num_free_pages() == free0
    assert engine.runner.sequence_ids() == []
    (final,) = outs
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert not engine.scheduler.has_work()
    engine.abort(rid)  # idempotent
    engine.run_step()


def test_abort_mid_decode_and_on_client_disconnect():
    async def main():
        engine = make_engine(prefix=False)
        free0 = engine.runner.num_free_pages()
        # Explicit abort while streaming.
        gen = engine.add_request(prompt(20), greedy(100), request_id="a")
        seen = [await gen.__anext__() for _ in range(3)]
        engine.abort("a")
        rest = [o async for o in gen]
        assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
        # Client goes away: closing the stream aborts the request.
        gen = engine.add_request(prompt(20, 2), greedy(100), request_id="b")
        await gen.__anext__()
        await gen.aclose()
        deadline = asyncio.get_running_loop().time() + 10
        while engine.stats().num_running or engine.stats().num_waiting:
            assert asyncio.get_running_loop().time() < deadline, "the abort never took effect"
            await asyncio.sleep(0.001)
        await engine.shutdown()
        return engine, free0, seen

    engine, free0, seen = asyncio.run(main())
    assert tokens_of(seen) == oracle(prompt(20), 3)
    assert engine.runner.num_free_pages() == free0


def test_n_abort_before_fork_finishes_every_completion():
    engine = make_engine(prefill_chunk_size=8, max_num_batched_tokens=8)
    outs: list = []
    rid = engine.submit(prompt(40), greedy(5, n=3), outs.append)
    engine.run_step()
    engine.abort(rid)
    engine.run_step()
    assert outs[-1].finished
    assert sorted(d.index for d in outs[-1].outputs) == [0, 1, 2]
    assert engine.runner.num_free_pages() == engine.runner.num_pages


def test_requests_that_can_never_fit_are_rejected_before_streaming():
    async def main():
        engine = make_engine(num_pages=16)
        with pytest.raises(ContextLengthExceededError):
            engine.add_request(prompt(250), greedy(10))  # > 256-token context window
        with pytest.raises(ContextLengthExceededError):
            engine.add_request(prompt(60), greedy(10))  # 70 tokens > 15 usable pages
        with pytest.raises(ValueError):
            engine.add_request([V + 5], greedy(1))
        assert engine.stats().num_waiting == 0
        ok = await collect(engine, prompt(10), greedy(3))
        await engine.shutdown()
        return ok

    assert tokens_of(asyncio.run(main())) == oracle(prompt(10), 3)


def test_eos_and_stop_token_ids_finish_with_stop():
    p = prompt(12)
    ref = oracle(p, 10)
    engine = make_engine(eos=[ref[3]])
    (outs,) = engine.generate([p], greedy(10))
    assert tokens_of(outs) == ref[:3]
    assert outs[-1].outputs[0].finish_reason == "stop"
    assert outs[-1].usage.completion_tokens == 4  # the EOS token counts, but is not returned
    (outs,) = engine.generate([p], greedy(10, ignore_eos=True))
    assert tokens_of(outs) == ref
    (outs,) = engine.generate([p], greedy(10, stop_token_ids=[ref[1]]))
    assert tokens_of(outs) == ref[:1] and outs[-1].outputs[0].finish_reason == "stop"


def test_text_stop_strings_and_logprobs():
    tok = word_tokenizer()
    p = prompt(12)
    ref = oracle(p, 10)
    full = tok.decode(ref)
    engine = make_engine(tokenizer=tok)
    (outs,) = engine.generate([p], greedy(10, logprobs=True, top_logprobs=2))
    assert "".join(d.text for o in outs for d in o.outputs) == full
    lps = [lp for o in outs for d in o.outputs for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == ref
    assert all(lp.top_logprobs[0][0] == lp.token_id for lp in lps)  # greedy: the top one
    assert all(lp.logprob <= 0 for lp in lps)

    stop = " " + full.split(" ")[4]
    (outs,) = engine.generate([p], greedy(10, stop=[stop]))
    text = "".join(d.text for o in outs for d in o.outputs)
    assert text == full[: full.index(stop)]
    assert outs[-1].outputs[0].finish_reason == "stop"
    assert len(tokens_of(outs)) < 10


def test_shutdown_aborts_in_flight_requests():
    async def main():
        engine = make_engine()
        gen = engine.add_request(prompt(20), greedy(200))
        await gen.__anext__()
        await engine.shutdown()
        rest = [o async for o in gen]
        return engine, rest

    engine, rest = asyncio.run(main())
    assert rest[-1].outputs[-1].finish_reason == "abort"
    assert not engine.scheduler.has_work()


def test_n_with_one_token_and_a_mid_page_prompt():
    engine = make_engine()
    (outs,) = engine.generate([prompt(7)], greedy(1, n=3))
    assert [tokens_of(outs, i) for i in range(3)] == [oracle(prompt(7), 1)] * 3
    assert outs[-1].finished


@pytest.mark.parametrize("seed", range(4))
def test_mixed_workload_under_pressure_matches_roomy_engine(seed):
    rng = np.random.default_rng(seed)
    shared = prompt(20, 50)
    work = []
    for i in range(10):
        head = shared[: int(rng.integers(0, 21))]
        p = head + prompt(int(rng.integers(1, 15)), int(rng.integers(0, V)))
        temp = float(rng.choice([0.0, 0.8]))
        n = int(rng.choice([1, 1, 2, 3]))
        params = SamplingParams(max_tokens=int(rng.integers(1, 20)), temperature=temp, n=n, seed=i)
        work.append((p, params))

    def run(engine):
        results = engine.generate([p for p, _ in work], [params for _, params in work])
        return [
            [tokens_of(r, i) for i in range(params.n)]
            for r, (_, params) in zip(results, work, strict=True)
        ]

    roomy = make_engine(num_pages=512, prefix=False)
    tight = make_engine(num_pages=40, max_num_batched_tokens=24, prefill_chunk_size=8)
    assert run(tight) == run(roomy)
    tight.scheduler.kv.evict_all()
    assert tight.runner.num_free_pages() == tight.runner.num_pages


def test_a_failing_step_fails_its_requests_and_the_engine_recovers():
    class Boom(RuntimeError):
        pass

    async def main():
        engine = make_engine(prefix=False)
        real_forward = engine.runner.forward
        calls = {"n": 0}

        def flaky(items):
            calls["n"] += 1
            if calls["n"] == 3:
                raise Boom("device lost")
            return real_forward(items)

        engine.runner.forward = flaky
        with pytest.raises(Boom):
            await collect(engine, prompt(10), greedy(10))
        ok = await collect(engine, prompt(10), greedy(4))
        await engine.shutdown()
        return ok

    assert tokens_of(asyncio.run(main())) == oracle(prompt(10), 4)
