"""Speculative decoding over compiled models: the verification forward's rows against
token-by-token decode, the KV cache after a rollback, and engine outputs with and without
speculation (tiny random Qwen3 in float32; the embedded SmolLM2 on a copying task)."""

from __future__ import annotations

import numpy as np
import pytest

from tallow.runtime.engine_factory import EngineOptions, build_engine
from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.speculation_costs import SCRATCH_SEQ
from tallow.runtime.speculative import NgramProposer, SpeculationPolicy, SpeculativeConfig

pytestmark = pytest.mark.slow

RNG = np.random.default_rng(3)
BASE = [int(t) for t in RNG.integers(3, 300, size=12)]


@pytest.fixture(scope="module")
def qwen3(tiny_artifact):
    return tiny_artifact("qwen3", "f32")


@pytest.fixture(scope="module")
def runner(qwen3):
    return TVMModelRunner(qwen3, kv=KVCacheConfig(max_batch_size=8, max_total_tokens=4096))


def decode_one_by_one(runner, seq_id: int, prompt: list[int], tokens: list[int]) -> np.ndarray:
    runner.add_sequence(seq_id)
    runner.forward([(seq_id, prompt)])
    rows = [np.array(runner.forward([(seq_id, [t])]))[0].copy() for t in tokens]
    runner.remove_sequence(seq_id)
    return np.stack(rows)


@pytest.mark.parametrize("with_prefill", [False, True], ids=["verify-only", "beside-a-prefill"])
def test_verification_rows_equal_token_by_token_decode(runner, with_prefill):
    """Every fed token's logits, for two sequences at once: through `batch_decode` over the
    tokens (a step of decodes and verifications) or `batch_prefill` at those positions (a
    step with a prefill chunk too)."""
    prompts = [BASE[:9], BASE[3:]]
    fed = [[7, 41, 99, 5], [12, 13]]
    want = [
        decode_one_by_one(runner, 50 + i, p, f)
        for i, (p, f) in enumerate(zip(prompts, fed, strict=True))
    ]
    for i, p in enumerate(prompts):
        runner.add_sequence(i)
        runner.forward([(i, p)])
    items = [(0, fed[0]), (1, fed[1])]
    counts = [4, 2]
    if with_prefill:
        runner.add_sequence(2)
        items.append((2, BASE))
        counts.append(1)
    got = np.array(runner.forward(items, counts))
    for s in range(len(items)):
        runner.remove_sequence(s)
    assert got.shape == (sum(counts), runner.vocab_size)
    np.testing.assert_allclose(got[:4], want[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[4:6], want[1], rtol=1e-4, atol=1e-4)


def test_rollback_leaves_exactly_the_accepted_tokens(runner):
    """Verify 4 proposals, keep 1: the cache's pages and the next token's logits are those of
    a sequence that never held the rejected three."""
    prompt, last, proposals = BASE[:16], 8, [21, 22, 23, 24]
    free = runner.num_free_pages()
    runner.add_sequence(0)
    runner.forward([(0, prompt)])
    runner.forward([(0, [last, *proposals])], [5])
    runner.popn(0, 3)  # keep last + proposals[0]
    assert free - runner.num_free_pages() == -(-(len(prompt) + 2) // runner.page_size)
    after = np.array(runner.forward([(0, [77])]))[0].copy()
    runner.remove_sequence(0)
    assert runner.num_free_pages() == free
    want = decode_one_by_one(runner, 9, prompt, [last, proposals[0], 77])[-1]
    np.testing.assert_allclose(after, want, rtol=1e-4, atol=1e-4)


def tokens(outputs) -> list[int]:
    return [t for o in outputs for d in o.outputs for t in d.token_ids]


def forced_speculation(engine) -> SpeculationPolicy:
    """A policy that proposes whenever the n-grams match, at any batch size (the CPU's cost
    model proposes little at batch 16: these tests need verification to run)."""
    engine.scheduler.speculation = SpeculationPolicy(
        SpeculativeConfig(row_cost=0.0), NgramProposer()
    )
    return engine.scheduler.speculation


def test_greedy_equal_without_speculation_16_concurrent(qwen3):
    prompts = [(BASE * 4)[: 30 + i] for i in range(16)]
    params = [
        SamplingParams(max_tokens=8 + 3 * (i % 7), temperature=0.0, ignore_eos=True)
        for i in range(16)
    ]
    plain = [tokens(o) for o in build_engine(qwen3, EngineOptions()).generate(prompts, params)]
    engine = build_engine(qwen3, EngineOptions())
    policy = forced_speculation(engine)
    fast = [tokens(o) for o in engine.generate(prompts, params)]
    assert fast == plain
    assert policy.stats.accepted >= 5 and policy.stats.proposed > policy.stats.accepted
    assert [len(t) for t in fast] == [p.max_tokens for p in params]


COPY = (
    "Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, "
    "fig, grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya."
)
COPY_WORDS = (
    "Copy these words exactly, separated by commas: Monday, Tuesday, Wednesday, Thursday, "
    "Friday, Saturday, Sunday, January, February, March, April, May."
)


def test_smollm2_copying_speculates_and_keeps_the_greedy_text(smollm2_artifact):
    """Greedy text with prompt lookup equals the text without, up to the first token the
    model nearly ties on: verification's kernels round differently from decode's (as a
    batch of another size does; docs/speculative.md), so a near-tie may go either way.

    The first copying prompt whose reference is sure of its first 10 tokens is used: where
    a reference nearly ties depends on the CPU's kernels (COPY's second token has a top-2
    margin of 0.96-1.0 nats, on either side of the bar from one kernel change to the next)."""
    plain_engine = build_engine(smollm2_artifact, EngineOptions(threads=1))
    params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=True, top_logprobs=2)
    for prompt in (COPY, COPY_WORDS):
        ids = plain_engine.model.encode_chat([{"role": "user", "content": prompt}])
        steps_before = plain_engine.stats().num_steps  # (cumulative over the engine's life)
        plain = plain_engine.generate([ids], params)[0]
        plain_steps = plain_engine.stats().num_steps - steps_before
        tops = [lp.top_logprobs for o in plain for d in o.outputs for lp in d.logprobs]
        margins = [a[1] - b[1] for a, b in tops]
        # the first token comes from the prompt's prefill in both runs: the same kernels
        sure = next((i for i, m in enumerate(margins) if i and m < 1.0), len(margins))
        if sure >= 10:
            break
    assert sure >= 10, "every reference is a near-tie early on: add another prompt"
    spec_engine = build_engine(
        smollm2_artifact, EngineOptions(threads=1, speculative=SpeculativeConfig())
    )
    fast = spec_engine.generate([ids], params)[0]
    assert tokens(fast)[:sure] == tokens(plain)[:sure]
    stats = spec_engine.scheduler.speculation.stats
    assert stats.acceptance_rate > 0.5
    assert spec_engine.stats().num_steps < plain_steps * 0.7
    # the policy got this model's measured step costs, and the scratch sequence is gone
    config = spec_engine.scheduler.speculation.config
    assert config.single_cost is not None and 0 < config.row_cost < 1
    spec_engine.runner.add_sequence(SCRATCH_SEQ)  # raises if the measurement left it there
    spec_engine.runner.remove_sequence(SCRATCH_SEQ)


def test_server_streams_speculated_runs_and_counts_them(smollm2_artifact):
    """Through the official client: a streamed chat equals the non-streamed one, a request
    with `speculative: false` proposes nothing, and /metrics counts what was verified.
    No prefix cache: a repeated request would prefill only the prompt's last rows, another
    computation (float and int8 rounding move this model's logits by up to ~1 between
    chunkings), and this prompt's first token is a near-tie ("apple" against "The", ~0.1
    apart): each request here computes the same rows the same way."""
    import openai
    from server_helpers import metric, serve_engine

    from tallow.server.app import ServerOptions

    engine = build_engine(
        smollm2_artifact,
        EngineOptions(threads=1, prefix_cache=False, speculative=SpeculativeConfig()),
    )
    live = serve_engine(engine, ServerOptions())
    try:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="none")
        ask = dict(
            model="tiny",
            messages=[{"role": "user", "content": COPY}],
            max_tokens=60,
            temperature=0,
        )
        whole = client.chat.completions.create(**ask).choices[0].message.content
        proposed = metric(live.base_url, "tallow_spec_proposed_tokens_total")
        accepted = metric(live.base_url, "tallow_spec_accepted_tokens_total")
        assert proposed > 0 and accepted / proposed > 0.5
        chunks = list(client.chat.completions.create(**ask, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
        # accepted runs arrive as one delta each: fewer content chunks than tokens
        usage = client.chat.completions.create(**ask).usage
        content = [c for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(content) < usage.completion_tokens
        before = metric(live.base_url, "tallow_spec_proposed_tokens_total")
        opted_out = client.chat.completions.create(**ask, extra_body={"speculative": False})
        assert opted_out.choices[0].message.content.startswith(whole[:20])
        assert metric(live.base_url, "tallow_spec_proposed_tokens_total") == before
    finally:
        live.stop()


def test_generate_command_speculates_and_says_how_much(smollm2_artifact, capsys):
    from tallow.cli.main import main

    common = ["generate", str(smollm2_artifact), "--chat", "--prompt", COPY]
    common += ["--temperature", "0", "--max-tokens", "40", "--threads", "1"]
    assert main(common) == 0
    plain = capsys.readouterr()
    assert main([*common, "--speculative", "ngram", "--num-speculative-tokens", "4"]) == 0
    fast = capsys.readouterr()
    assert fast.out[:30] == plain.out[:30]
    summary = fast.err.strip().splitlines()[-1]
    assert "speculative:" in summary and "proposed tokens accepted" in summary
    assert main([*common, "--speculative", "ngram", "--num-speculative-tokens", "40"]) == 2
    assert "--num-speculative-tokens: between 1 and 16" in capsys.readouterr().err


@pytest.mark.parametrize("draft_name", ["qwen3", "llama"], ids=["itself", "another-model"])
def test_draft_model_keeps_outputs(qwen3, tiny_artifact, draft_name):
    """A draft artifact with the same tokenizer: the model itself (every greedy guess right)
    and another tiny model (few right); the outputs are those without speculation."""
    import dataclasses

    draft = tiny_artifact(draft_name, "f32")
    prompts = [(BASE * 3)[: 20 + 3 * i] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [tokens(o) for o in build_engine(qwen3, EngineOptions()).generate(prompts, params)]
    spec = SpeculativeConfig(kind="draft", draft=str(draft), num_speculative_tokens=4)
    engine = build_engine(qwen3, EngineOptions(speculative=spec))
    policy = engine.scheduler.speculation
    # same-sized tiny models: the cost model would never draft; these tests need it to
    policy.config = dataclasses.replace(policy.config, row_cost=0.0, proposal_cost=0.0)
    assert [tokens(o) for o in engine.generate(prompts, params)] == plain
    if draft_name == "qwen3":
        assert policy.stats.acceptance_rate > 0.9
    else:
        assert policy.stats.proposed > 20
    assert policy.proposer.runner.num_free_pages() == policy.proposer.runner.num_pages


def test_draft_flags_are_checked_before_loading(smollm2_artifact, capsys, tmp_path):
    from tallow.cli.main import main

    common = ["generate", str(smollm2_artifact), "--prompt", "hi"]
    assert main([*common, "--draft", str(smollm2_artifact)]) == 2
    assert "--draft goes with --speculative draft" in capsys.readouterr().err
    assert main([*common, "--speculative", "draft"]) == 2
    assert "--draft ARTIFACT goes with --speculative draft" in capsys.readouterr().err
    assert main([*common, "--speculative", "draft", "--draft", str(tmp_path)]) == 2
    assert "not an artifact folder" in capsys.readouterr().err
