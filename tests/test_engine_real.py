"""The engine over a real compiled model (tiny random Qwen3, and SmolLM2 where installed)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tallow.runtime.engine_factory import EngineOptions, build_engine
from tallow.runtime.sampler import log_softmax
from tallow.runtime.sampling_params import SamplingParams

from conftest_gguf import smollm2_gguf  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

RNG = np.random.default_rng(7)
PROMPTS = [[int(t) for t in RNG.integers(3, 300, size=n)] for n in (3, 9, 17, 30, 41, 5, 64, 12)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def collect(outputs) -> dict:
    """Token ids, text, finish reasons and logprobs per completion index."""
    result: dict[int, dict] = {}
    for out in outputs:
        for d in out.outputs:
            r = result.setdefault(d.index, {"ids": [], "text": "", "finish": None, "lp": []})
            r["ids"] += d.token_ids
            r["text"] += d.text
            r["lp"] += d.logprobs or []
            r["finish"] = d.finish_reason or r["finish"]
    return result


def run_alone(artifact, prompt, params, **opts):
    engine = build_engine(artifact, EngineOptions(**opts))
    return collect(engine.generate([prompt], params)[0])[0]


@pytest.fixture(scope="module")
def qwen3(tiny_artifact):
    return tiny_artifact("qwen3", "f32")


def test_concurrent_requests_equal_alone(qwen3):
    alone = [run_alone(qwen3, p, GREEDY)["ids"] for p in PROMPTS]
    engine = build_engine(qwen3, EngineOptions(max_num_seqs=8, prefill_chunk_size=32))

    async def run_all():
        engine.start()

        async def one(p):
            return [o async for o in engine.add_request(p, GREEDY)]

        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await engine.shutdown()

    together = [collect(outs)[0]["ids"] for outs in asyncio.run(run_all())]
    assert together == alone
    assert engine.stats().num_preemptions == 0


def test_preemption_keeps_outputs(qwen3):
    alone = [run_alone(qwen3, p, GREEDY)["ids"] for p in PROMPTS[:6]]
    # 512 bytes/token for this model: 0.05 MB holds ~100 tokens, far less than 6 sequences need
    engine = build_engine(qwen3, EngineOptions(max_num_seqs=6, kv_cache_mem_mb=0.05))
    free0 = engine.runner.num_free_pages()
    results = engine.generate(PROMPTS[:6], GREEDY)
    assert engine.stats().num_preemptions > 0
    assert [collect(r)[0]["ids"] for r in results] == alone
    # Every request has ended: once the idle prefix-cache entries go, every page is back.
    st = engine.stats()
    assert st.num_running == 0 and st.num_waiting == 0
    engine.scheduler.kv.evict_all()
    assert engine.runner.num_free_pages() == free0
    assert engine.stats().kv_pages_used == 0


def test_prefix_cache_hits_and_outputs_unchanged(qwen3):
    system = [int(t) for t in RNG.integers(3, 300, size=48)]
    prompts = [system + [5, 6, 7], system + [9, 10], system + [11]]
    alone = [run_alone(qwen3, p, GREEDY, prefix_cache=False)["ids"] for p in prompts]
    engine = build_engine(qwen3, EngineOptions(max_num_seqs=4))
    got = [collect(engine.generate([p], GREEDY)[0])[0]["ids"] for p in prompts]
    assert got == alone
    assert engine.stats().prefix_cache_hit_tokens >= 2 * 48 - 2 * 16


def test_abort_mid_prefill_and_mid_decode_frees_pages(qwen3):
    engine = build_engine(qwen3, EngineOptions(max_num_seqs=4, prefix_cache=False))
    start = engine.runner.num_free_pages()
    long_prompt = [int(t) for t in RNG.integers(3, 300, size=100)]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    sink: list = []
    rid_prefill = engine.submit(long_prompt, params, sink.append)
    rid_decode = engine.submit(PROMPTS[0], params, sink.append)
    engine.scheduler.config.prefill_chunk_size = 16  # make the long prefill take several steps
    for _ in range(3):
        engine.run_step()
    assert engine.runner.num_free_pages() < start
    engine.abort(rid_prefill)
    engine.abort(rid_decode)
    while engine._has_work():
        engine.run_step()
    assert engine.runner.num_free_pages() == start
    reasons = {d.finish_reason for o in sink if not isinstance(o, BaseException) for d in o.outputs}
    assert "abort" in reasons


def test_seeded_sampling_independent_of_companions(qwen3):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = run_alone(qwen3, PROMPTS[2], params)["ids"]
    engine = build_engine(qwen3, EngineOptions(max_num_seqs=8))
    noisy = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    results = engine.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]], [noisy, params, noisy])
    assert collect(results[1])[0]["ids"] == alone


def test_logprobs_are_log_softmax_of_model_logits(qwen3):
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=3)
    engine = build_engine(qwen3, EngineOptions(max_num_seqs=2, prefix_cache=False))
    out = collect(engine.generate([PROMPTS[3]], params)[0])[0]
    runner = engine.runner
    runner.add_sequence(999)
    logits = runner.forward([(999, PROMPTS[3])])
    runner.remove_sequence(999)
    ref = log_softmax(logits.astype(np.float64))[0]
    lp = out["lp"][0]
    assert lp.token_id == int(np.argmax(ref))
    assert abs(lp.logprob - ref[lp.token_id]) < 1e-4
    top = [t for t, _ in lp.top_logprobs]
    assert top == [int(i) for i in np.argsort(-ref)[:3]]


def test_n_greater_than_one_shares_the_prompt(qwen3):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=3, ignore_eos=True)
    engine = build_engine(qwen3, EngineOptions(max_num_seqs=4, prefix_cache=False))
    computed: list[int] = []  # tokens each forward feeds the model, as the runner sees them
    forward = engine.runner.forward

    def counting_forward(items):
        computed.append(sum(len(toks) for _, toks in items))
        return forward(items)

    engine.runner.forward = counting_forward
    out = collect(engine.generate([PROMPTS[6]], params)[0])
    assert sorted(out) == [0, 1, 2] and all(len(r["ids"]) == 8 for r in out.values())
    # Prefilled once, then forked: the prompt once, and each completion's tokens but its last
    # (never fed back). Prefilling per completion would add 2 * len(prompt).
    assert sum(computed) == len(PROMPTS[6]) + 3 * (8 - 1)


def test_stop_string_across_tokens_smollm2(smollm2_gguf, tmp_path_factory):  # noqa: F811
    from tallow.compiler.pipeline import CompileOptions, compile_model

    art = compile_model(
        CompileOptions(model=str(smollm2_gguf), output=tmp_path_factory.mktemp("s"), quiet=True)
    )
    engine = build_engine(art, EngineOptions(max_num_seqs=2))
    ids = engine.tokenizer.encode("The capital of France is").ids
    free = collect(engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0])[0]
    assert free["text"].startswith(" Paris.")
    # "s." spans the end of " Paris" and the "." token: cut there, the stop string removed
    stop = SamplingParams(max_tokens=8, temperature=0.0, stop=["s."])
    out = collect(engine.generate([ids], stop)[0])[0]
    assert out["text"] == " Pari" and out["finish"] == "stop"


def test_runner_logits_stay_valid_after_later_forwards(qwen3):
    """On the CPU `forward` returns a view of the model's output tensor, not a copy: it must
    keep that tensor alive, so later forwards cannot overwrite logits already handed out."""
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    runner = TVMModelRunner(qwen3, kv=KVCacheConfig(4, 512, 64))
    for seq in (0, 1):
        runner.add_sequence(seq)
    first = runner.forward([(0, PROMPTS[1]), (1, PROMPTS[2])])
    kept = first.copy()
    for step in range(6):  # decode steps and a prefill, each with fresh outputs
        runner.forward([(0, [7 + step]), (1, [9 + step])])
    runner.forward([(1, PROMPTS[3])])
    np.testing.assert_array_equal(first, kept)
    assert not np.array_equal(first, runner.forward([(0, [3]), (1, [4])]))


def test_artifact_samples_on_the_device(qwen3):
    """The artifact carries the compiled sampler; plain requests use it, logprobs do not."""
    from tallow.runtime.model_runner_protocol import SamplingControls
    from tallow.runtime.sampler import sample_controls

    engine = build_engine(qwen3, EngineOptions(max_num_seqs=8, prefix_cache=False))
    runner = engine.runner
    assert runner.supports_device_sampling and "sample_tokens" in runner.manifest.functions
    seqs = range(100, 106)
    for s in seqs:
        runner.add_sequence(s)
    logits = np.asarray(runner.forward([(s, PROMPTS[s % 8]) for s in seqs]))
    rng = np.random.default_rng(0)
    for _ in range(10):
        c = SamplingControls(
            temperature=rng.choice([0.0, 0.7, 1.3], 6).astype(np.float32),
            top_k=rng.choice([0, 3, 50], 6).astype(np.int32),
            top_p=rng.choice([1.0, 0.9, 0.3], 6).astype(np.float32),
            min_p=rng.choice([0.0, 0.05], 6).astype(np.float32),
            uniform=rng.random(6).astype(np.float32),
        )
        np.testing.assert_array_equal(runner.sample(c), sample_controls(logits, c))
    for s in seqs:
        runner.remove_sequence(s)

    plain = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=2, ignore_eos=True)
    asks_logprobs = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, ignore_eos=True)
    engine.generate([PROMPTS[1], PROMPTS[2]], [plain, asks_logprobs])
    assert engine.sampling.device_rows == 6 and engine.sampling.host_rows == 6


def test_device_and_host_sampling_agree_on_a_real_model(qwen3):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.9, seed=77)
    outs = []
    for device in (True, False):
        engine = build_engine(qwen3, EngineOptions(max_num_seqs=4))
        engine.sampling.on_device = device
        outs.append([collect(r)[0]["ids"] for r in engine.generate(PROMPTS[:3], params)])
    assert outs[0] == outs[1]
