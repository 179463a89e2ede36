"""Speculative decoding on the fake runner: the same tokens as without it (greedy and seeded),
the KV cache rolled back to exactly the accepted tokens, the rejection rule's distribution,
and the policy that decides how much to propose. No TVM; milliseconds per run."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_fake import V, prompt, tokens_of, word_tokenizer

from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.request import SequenceState
from tallow.runtime.sampler import warp_logits
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.scheduler import SchedulerConfig
from tallow.runtime.speculative import (
    NgramProposer,
    SpeculationPolicy,
    SpeculativeConfig,
    _Acceptance,
)


class OracleProposer:
    """Proposes the greedy continuation (from the fake runner's reference logits), each
    proposal replaced by a wrong token with probability `wrong`: acceptance is then known."""

    def __init__(self, wrong: float = 0.3, seed: int = 0) -> None:
        self.ref = FakeModelRunner(vocab_size=V)
        self.rng = np.random.default_rng(seed)
        self.wrong = wrong
        self.calls = 0

    def propose(self, seq: SequenceState, k: int) -> list[int]:
        self.calls += 1
        toks, out = list(seq.token_ids), []
        for _ in range(k):
            t = int(np.argmax(self.ref.reference_logits(toks)))
            if self.rng.random() < self.wrong:
                t = (t + 1 + int(self.rng.integers(V - 1))) % V
            out.append(t)
            toks.append(t)
        return out


class CheckedEngine(Engine):
    """After every step, each running sequence's KV holds exactly its computed tokens."""

    def step(self) -> None:
        super().step()
        runner = self.runner
        for s in self.scheduler.running:
            held = runner.sequence_tokens(s.seq_id)
            assert held == s.token_ids[: s.num_computed_tokens], f"seq {s.seq_id} KV drifted"


def make_engine(proposer=None, k: int = 4, row_cost: float = 0.02, **cfg) -> Engine:
    runner = FakeModelRunner(page_size=4, num_pages=256, vocab_size=V, context_window=256)
    cfg.setdefault("max_num_batched_tokens", 96)
    cfg.setdefault("prefill_chunk_size", 16)
    cfg.setdefault("max_num_seqs", 16)
    config = SchedulerConfig(prefix_cache_max_tokens=256, **cfg)
    engine = CheckedEngine(
        runner, tokenizer=word_tokenizer(), eos_token_ids=(), scheduler_config=config
    )
    if proposer is not None:
        spec = SpeculativeConfig(num_speculative_tokens=k, row_cost=row_cost)
        engine.scheduler.speculation = SpeculationPolicy(spec, proposer)
    return engine


def run(engine: Engine, prompts, params) -> list[list[int]]:
    outs = engine.generate(prompts, params)
    return [tokens_of(o) for o in outs]


def texts(engine: Engine, prompts, params) -> list[str]:
    outs = engine.generate(prompts, params)
    return ["".join(d.text for o in out for d in o.outputs) for out in outs]


PROMPTS = [prompt(5 + 3 * i, start=i) for i in range(16)]


def test_greedy_tokens_equal_without_speculation_16_concurrent():
    params = [SamplingParams(max_tokens=7 + 5 * (i % 5), temperature=0.0) for i in range(16)]
    plain = run(make_engine(), PROMPTS, params)
    spec_engine = make_engine(OracleProposer(wrong=0.3))
    fast = run(spec_engine, PROMPTS, params)
    assert fast == plain
    stats = spec_engine.scheduler.speculation.stats
    assert stats.proposed > 50 and 0.3 < stats.acceptance_rate < 0.95
    # fewer forwards than tokens: runs of accepted proposals came out of one step
    assert spec_engine.stats().num_steps < make_engine_steps(plain)


def make_engine_steps(plain: list[list[int]]) -> int:
    return max(len(t) for t in plain) + len(PROMPTS)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6])
def test_max_tokens_inside_an_accepted_run(max_tokens):
    """A run never passes max_tokens, whatever was proposed (k = 4 > max_tokens - 1)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    plain = run(make_engine(), PROMPTS[:4], params)
    fast = run(make_engine(OracleProposer(wrong=0.0)), PROMPTS[:4], params)
    assert fast == plain and all(len(t) == max_tokens for t in fast)


def test_stop_strings_and_logprobs_inside_a_run():
    # w-tokens are words: stop at the 3rd output word of the plain run
    base = SamplingParams(max_tokens=12, temperature=0.0)
    plain_tokens = run(make_engine(), PROMPTS[:1], base)[0]
    stop = f"w{plain_tokens[3]}"
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], logprobs=True)
    plain = make_engine().generate(PROMPTS[:1], params)[0]
    fast = make_engine(OracleProposer(wrong=0.0)).generate(PROMPTS[:1], params)[0]
    assert tokens_of(fast) == tokens_of(plain)
    text = "".join(d.text for o in fast for d in o.outputs)
    assert stop not in text and fast[-1].outputs[-1].finish_reason == "stop"
    lp_plain = [lp.logprob for o in plain for d in o.outputs for lp in d.logprobs]
    lp_fast = [lp.logprob for o in fast for d in o.outputs for lp in d.logprobs]
    assert np.allclose(lp_fast, lp_plain, atol=1e-5) and len(lp_fast) == len(tokens_of(fast))


def test_seeded_sampling_equal_without_speculation():
    """Each emitted token takes its stream's draw as without speculation: the rows the
    verification rejected are rewound, so seeded outputs are the same tokens."""
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=100 + i, n=1 + i % 2)
        for i in range(16)
    ]
    plain = [[tokens_of(o, j) for j in range(2)] for o in make_engine().generate(PROMPTS, params)]
    eng = make_engine(OracleProposer(wrong=0.2))
    fast = [[tokens_of(o, j) for j in range(2)] for o in eng.generate(PROMPTS, params)]
    assert fast == plain
    assert eng.scheduler.speculation.stats.accepted > 20


def test_penalties_see_the_proposals_before_each_row():
    params = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.5)
    plain = run(make_engine(), PROMPTS[:6], params)
    fast = run(make_engine(OracleProposer(wrong=0.0)), PROMPTS[:6], params)
    assert fast == plain


def test_preemption_and_prefix_cache_with_speculation():
    """A cache too small for every sequence: preemptions recompute, prefixes are reused."""
    shared = prompt(12, start=3)
    prompts = [shared + prompt(3, start=i) for i in range(10)]
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def small(proposer=None):
        eng = make_engine(proposer)
        eng.runner.__init__(page_size=4, num_pages=40, vocab_size=V, context_window=256)
        eng.scheduler.kv.num_pages = 40
        return eng

    plain = run(make_engine(), prompts, params)
    eng = small(OracleProposer(wrong=0.2))
    assert run(eng, prompts, params) == plain
    assert eng.scheduler.num_preemptions > 0
    assert eng.scheduler.kv.prefix_hit_tokens > 0


def test_rejection_rule_keeps_the_distribution():
    """Token frequencies with speculation against the exact distribution.

    The proposal is the most likely first token, so the second emitted token comes from the
    verified row when it is accepted and from the next step's decode when not: its exact
    marginal is sum_t p(t) p(. | t). 6,000 unseeded requests; the tolerance is three times
    the total-variation distance that sampling the exact distribution itself shows at this
    count (its 99th percentile over 200 simulated runs)."""
    n, temperature = 6000, 1.0
    p_in = prompt(6, start=11)
    ref = FakeModelRunner(vocab_size=V)
    sp = SamplingParams(max_tokens=2, temperature=temperature)

    def dist(tokens):
        x = warp_logits(ref.reference_logits(tokens)[None, :].copy(), [sp])[0]
        e = np.exp(x - x.max())
        return e / e.sum()

    p0 = dist(p_in)
    marginal = sum(p0[t] * dist([*p_in, t]) for t in range(V))
    first = int(np.argmax(p0))

    class FirstToken:
        def propose(self, seq, k):
            return [first] if seq.num_output_tokens == 0 else []

    eng = make_engine(FirstToken(), k=1, row_cost=0.0)
    eng.scheduler.speculation._acceptance.clear()
    outs = eng.generate([p_in] * n, sp)
    second = np.bincount([tokens_of(o)[1] for o in outs], minlength=V) / n
    first_seen = np.bincount([tokens_of(o)[0] for o in outs], minlength=V) / n
    rng = np.random.default_rng(0)
    noise = [0.5 * np.abs(rng.multinomial(n, marginal) / n - marginal).sum() for _ in range(200)]
    tol = 3 * float(np.quantile(noise, 0.99))
    assert 0.5 * np.abs(second - marginal).sum() < tol
    assert 0.5 * np.abs(first_seen - p0).sum() < tol
    assert eng.scheduler.speculation.stats.proposed > n / 2  # it did speculate


def test_ngram_proposer_takes_the_latest_longest_match():
    req_seq = SequenceState(0, None, 0, [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], prompt_len=12)
    # suffix [2, 3]: latest earlier match at index 5 -> 7, 8, 5
    assert NgramProposer(4, 2).propose(req_seq, 3) == [7, 8, 5]
    req_seq.token_ids = [4, 1, 2, 3, 6, 1, 2, 3, 7, 0, 1, 2, 3]
    # longest suffix first: [1, 2, 3] -> latest match at 5 gives 7, 0
    assert NgramProposer(4, 2).propose(req_seq, 2) == [7, 0]
    req_seq.token_ids = [1, 2, 3, 4]
    assert NgramProposer(4, 2).propose(req_seq, 3) == []


def _seq(seq_id: int, params: SamplingParams) -> SequenceState:
    from tallow.runtime.request import Request

    req = Request(str(seq_id), [1, 2, 3, 1, 2], params, seq_id)
    return SequenceState(seq_id, req, 0, [1, 2, 3, 1, 2], prompt_len=5)


class Fixed:
    def propose(self, seq, k):
        return [3, 1, 2, 3, 1, 2][:k]


def test_policy_speculates_less_as_acceptance_falls_and_batches_grow():
    spec = SpeculativeConfig(num_speculative_tokens=5, row_cost=0.25)
    params = SamplingParams(max_tokens=100, temperature=0.0)
    policy = SpeculationPolicy(spec, Fixed())
    one = [_seq(0, params)]
    assert len(policy.plan(one, 100)[0]) >= 1  # prior alpha 0.5 at batch 1: worth a try
    for _ in range(6):
        policy.record(0, 5, 5)  # everything accepted: the full 5
    assert len(policy.plan(one, 100)[0]) == 5
    for _ in range(20):
        policy.record(0, 3, 0)  # nothing accepted: it stops proposing
    assert policy.plan(one, 100) == {}
    # ... and tries again some tens of steps later (the text may have turned to quoting)
    idle = next(i for i in range(1000) if policy.plan(one, 100))
    assert 10 < idle < 300
    # at batch 16 a row costs what a sure token brings: moderate acceptance proposes nothing
    batch = [_seq(i, params) for i in range(16)]
    assert SpeculationPolicy(spec, Fixed()).plan(batch, 100) == {}
    # the budget caps the total
    sure = SpeculationPolicy(dataclasses_replace(spec, row_cost=0.0), Fixed())
    assert sum(len(v) for v in sure.plan(batch, 7).values()) == 7
    # opting out, and no room before max_tokens
    assert policy.plan([_seq(1, SamplingParams(max_tokens=100, speculative=False))], 100) == {}
    assert policy.plan([_seq(2, SamplingParams(max_tokens=1))], 100) == {}


def test_policy_counts_a_lone_sequences_cheaper_decode_step():
    """Where one sequence's plain step runs cheaper kernels than a forward of several rows
    (a 1.7B shape on the CPU: 100 ms against 278 ms for two rows, 355 ms for six), only
    long runs of likely guesses pay: the expected tokens per unit of cost decide, computed
    here by hand for alpha 0.5, 0.7 and 0.9."""
    from tallow.runtime.speculation_costs import StepCosts

    costs = StepCosts(single_ms=100.0, two_ms=278.0, many_ms=355.2, many=6)
    fixed, per_row, single = 239.4, 19.3, 100.0  # the straight line through 2 and 6 rows
    assert (costs.fixed_ms, costs.per_row_ms) == pytest.approx((fixed, per_row))
    row_cost, single_cost = costs.relative()
    spec = SpeculativeConfig(num_speculative_tokens=5, row_cost=row_cost, single_cost=single_cost)
    params = SamplingParams(max_tokens=100, temperature=0.0)

    def planned(alpha: float, batch: int = 1) -> int:
        policy = SpeculationPolicy(spec, Fixed())
        seqs = [_seq(i, params) for i in range(batch)]
        for i in range(batch):
            policy._acceptance[i] = _Acceptance(accepted=alpha * 100, tried=100)
        return sum(len(v) for v in policy.plan(seqs, 100).values())

    def rate(alpha: float, n: int) -> float:  # expected tokens per ms, one sequence
        cost = single if n == 0 else fixed + per_row * (1 + n)
        return sum(alpha**j for j in range(n + 1)) / cost

    for alpha in (0.5, 0.7, 0.9):
        best = max(range(6), key=lambda n: rate(alpha, n))
        assert planned(alpha) == best, alpha
    assert planned(0.5) == planned(0.7) == 0 and planned(0.9) == 5
    # with the single step as dear as any (1 + row_cost), alpha 0.5 pays at batch 1
    linear = SpeculationPolicy(dataclasses_replace(spec, single_cost=None), Fixed())
    linear._acceptance[0] = _Acceptance(accepted=50, tried=100)
    assert linear.plan([_seq(0, params)], 100)
    # at batch 2 every step already runs the multi-row kernels: alpha 0.7 pays there
    assert planned(0.7, batch=2) > 0
    # timings no straight line fits (a noisy machine) leave the defaults
    assert StepCosts(single_ms=10.0, two_ms=5.0, many_ms=100.0, many=6).relative() is None


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


class ReplayProposer:
    """Proposes a reference run's continuation of the same prompt, each token replaced by a
    random one with probability `wrong` (most of those break the grammar)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], wrong: float, vocab: int):
        self.reference, self.wrong, self.vocab = reference, wrong, vocab
        self.rng = np.random.default_rng(1)

    def propose(self, seq: SequenceState, k: int) -> list[int]:
        ref = self.reference[tuple(seq.token_ids[: seq.prompt_len])]
        out = list(ref[seq.num_output_tokens : seq.num_output_tokens + k])
        return [
            int(self.rng.integers(self.vocab)) if self.rng.random() < self.wrong else t for t in out
        ]


@pytest.mark.parametrize("device_sampling", [True, False])
def test_grammar_checks_proposals_and_outputs_stay_the_same(device_sampling):
    """JSON-schema requests: proposals the grammar refuses are cut before verification, each
    verified row is masked by the grammar after the proposals before it, and the outputs are
    the same as without speculation (and valid)."""
    import json

    import jsonschema
    from test_constraint import PERSON, VOCAB
    from test_constraint import make_engine as grammar_engine
    from test_constraint import run as grammar_run
    from tokenizers import Tokenizer

    from tallow.runtime.constraint import json_schema_grammar

    from tiny_models import make_tokenizer

    folder = __import__("tempfile").mkdtemp()
    make_tokenizer(__import__("pathlib").Path(folder), VOCAB)
    tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
    eos = tok.token_to_id("</s>")
    grammar = json_schema_grammar(PERSON)
    prompts = [prompt(4 + i, start=i) for i in range(8)]
    params = [
        SamplingParams(max_tokens=100, temperature=0.0 if i % 2 else 0.7, seed=i, grammar=grammar)
        for i in range(8)
    ]
    kw = {"device_sampling": device_sampling}
    plain = grammar_run(grammar_engine(tok, eos, **kw), prompts, params)
    reference = {tuple(p): plain[i][0][1] for i, p in enumerate(prompts)}
    eng = grammar_engine(tok, eos, **kw)
    spec = SpeculativeConfig(num_speculative_tokens=6, row_cost=0.0)
    eng.scheduler.speculation = SpeculationPolicy(spec, ReplayProposer(reference, 0.15, VOCAB))
    fast = grammar_run(eng, prompts, params)
    assert fast == plain
    done = [out[0][0] for out in fast if out[0][2] == "stop"]
    assert len(done) >= 4  # the others ran to max_tokens inside a long string
    for text in done:
        jsonschema.validate(json.loads(text), PERSON)
    stats = eng.scheduler.speculation.stats
    assert stats.accepted > 40 and stats.accepted < stats.proposed


class CheckedDraft:
    """A `DraftProposer` whose cache is compared with what it says it holds, every call."""

    def __init__(self, seed: int) -> None:
        from tallow.runtime.draft_proposer import DraftProposer

        runner = FakeModelRunner(page_size=4, num_pages=512, vocab_size=V, context_window=256)
        runner._seed = seed  # seed 0: the target's own logits, every guess right
        self.inner = DraftProposer(runner)

    def propose_batch(self, seqs, ks):
        out = self.inner.propose_batch(seqs, ks)
        runner = self.inner.runner
        for sid, held in self.inner._held.items():
            assert runner.sequence_tokens(sid) == held
        return out

    def propose(self, seq, k):
        return self.propose_batch([seq], [k]).get(seq.seq_id, [])

    def forget(self, seq_id):
        self.inner.forget(seq_id)


@pytest.mark.parametrize("seed", [0, 5], ids=["same-model", "other-model"])
def test_draft_model_outputs_equal_and_its_cache_follows(seed):
    params = [
        SamplingParams(max_tokens=6 + 3 * (i % 5), temperature=0.0 if i % 3 else 0.8, seed=i)
        for i in range(16)
    ]
    plain = run(make_engine(), PROMPTS, params)
    draft = CheckedDraft(seed)
    eng = make_engine(draft)
    assert run(eng, PROMPTS, params) == plain
    stats = eng.scheduler.speculation.stats
    if seed == 0:  # greedy rows always agree; sampled ones as often as p(argmax)
        assert stats.acceptance_rate > 0.6
    else:
        assert stats.proposed > 0 and stats.acceptance_rate < 0.3
    assert draft.inner._held == {} and draft.inner.runner.sequence_ids() == []


def test_draft_vocabulary_must_match():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from tallow.runtime.draft_proposer import check_same_vocabulary
    from tallow.runtime.errors import TallowError

    tok = word_tokenizer()
    other = Tokenizer(WordLevel({f"x{i}": i for i in range(V)}, unk_token="x0"))
    check_same_vocabulary(tok, tok, V, V)
    with pytest.raises(TallowError, match="101 token ids, the model's 102"):
        check_same_vocabulary(tok, tok, 102, 101)
    with pytest.raises(TallowError, match="other ids"):
        check_same_vocabulary(tok, other, V, V)
