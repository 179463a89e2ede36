"""Constrained decoding below the server: grammar builders and checks, the matcher, and the
engine's handling of constrained sequences (completion, dead ends, forks, preemption, batching,
the mask worker thread); the step sampler's mask path is in test_masked_sampling.py. Fake runner
and the tiny test tokenizer only: every test takes milliseconds."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance.numpy as lln
import numpy as np
import pytest

from tallow.runtime.constraint import (
    GrammarError,
    GrammarMatcher,
    check_grammar,
    choice_grammar,
    compute_masks,
    disallow_tokens,
    grammar_tokenizer,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    masks_to_bool,
    regex_grammar,
)
from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.sampling_params import SamplingParams, SamplingParamsError
from tallow.runtime.scheduler import SchedulerConfig

from tiny_models import make_tokenizer

VOCAB = 320  # logits width; the tiny tokenizer has 312 tokens, so 8 are padding

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder, VOCAB)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def eos(tokenizer) -> int:
    return tokenizer.token_to_id("</s>")


@pytest.fixture(scope="module")
def gtok(tokenizer, eos):
    return grammar_tokenizer(tokenizer, VOCAB, [eos])


def make_engine(tokenizer, eos, **kw) -> Engine:
    runner_kw = {"vocab_size": VOCAB, "context_window": 2048, "num_pages": 512}
    runner_kw.update({k: kw.pop(k) for k in list(kw) if k in ("num_pages", "device_sampling")})
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 256, **kw})
    return Engine(
        FakeModelRunner(**runner_kw),
        tokenizer=tokenizer,
        eos_token_ids=[eos],
        scheduler_config=config,
    )


def run(engine: Engine, prompts, params) -> list[dict[int, tuple[str, list[int], str]]]:
    """Each request's completions: index -> (text, token ids, finish reason)."""
    out = []
    for outs in engine.generate(prompts, params):
        seqs: dict[int, list] = {}
        for o in outs:
            for d in o.outputs:
                s = seqs.setdefault(d.index, ["", [], None])
                s[0] += d.text
                s[1] += d.token_ids
                s[2] = d.finish_reason
        out.append({i: tuple(v) for i, v in seqs.items()})
    return out


# -- builders and checks -------------------------------------------------------------------------


def test_builders_compile(gtok):
    for g in [
        json_schema_grammar(PERSON),
        json_object_grammar(),
        regex_grammar(r"\d{3}-[a-z]+"),
        choice_grammar(["yes", 'no "quoted"', "back\\slash", "ünï", "new\nline"]),
        lark_grammar('start: "a" b\nb: /[0-9]+/'),
    ]:
        check_grammar(g)
        check_grammar(g, gtok)
        assert isinstance(gtok.matcher(g), GrammarMatcher)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: json_schema_grammar({"type": "nope"}), "nope"),
        (lambda: regex_grammar("a(b"), "unclosed group"),
        (lambda: lark_grammar("start: foo"), "foo"),
        (lambda: json_schema_grammar({"type": "object", "not": {}}), "not"),
    ],
)
def test_bad_grammars_raise_with_llguidance_message(gtok, make, needle):
    g = make()
    for tok in (None, gtok):
        with pytest.raises(GrammarError, match=re.escape(needle)) as e:
            check_grammar(g, tok)
        assert isinstance(e.value, ValueError)
        assert "<grammar>" not in str(e.value)  # no dump of llguidance's internal state


def test_lenient_schema_ignores_unimplemented_keywords(gtok):
    check_grammar(json_schema_grammar({"type": "object", "not": {}}, strict=False), gtok)
    with pytest.raises(GrammarError):
        json_schema_grammar([1, 2])  # type: ignore[arg-type]
    with pytest.raises(GrammarError):
        choice_grammar([])


def test_mask_is_as_wide_as_logits_and_padding_never_allowed(gtok, tokenizer, eos):
    m = gtok.matcher(json_object_grammar())
    allowed = m.allowed_mask()
    assert allowed.shape == (VOCAB,) and allowed.dtype == bool
    assert not allowed[tokenizer.get_vocab_size() :].any()
    assert allowed[tokenizer.token_to_id("{")]
    assert not allowed[eos]  # an empty output is not an object
    # the bitmask layout agrees with llguidance's own numpy helper
    rows = compute_masks([m, m.clone()])
    ref = np.zeros((2, VOCAB), dtype=np.float32)
    lln.apply_token_bitmask_inplace(ref, rows)
    np.testing.assert_array_equal(masks_to_bool(rows, VOCAB), ref == 0)
    disallow_tokens(rows[0], [tokenizer.token_to_id("{")])
    assert masks_to_bool(rows, VOCAB)[0].sum() == allowed.sum() - 1


def test_matcher_accept_finish_dead_end_clone(gtok, tokenizer, eos):
    m = gtok.matcher(choice_grammar(["yes", "no"]))
    c = m.clone()
    for t in tokenizer.encode("no", add_special_tokens=False).ids:
        assert m.accept(t)
    assert m.is_finished and not m.is_dead_end and m.error == ""
    assert not c.is_finished and c.allowed_mask().sum() >= 2  # the clone is independent
    assert not c.accept(tokenizer.token_to_id("z"))
    assert c.is_dead_end and c.error
    dead = gtok.matcher(regex_grammar(r"a[^\s\S]"))  # no string matches it
    dead.allowed_mask()
    assert dead.is_dead_end and "no token" in dead.error
    m.reset()
    assert not m.is_finished


def test_grammar_tokenizer_cached_and_matchers_cached(tokenizer, eos, gtok):
    assert grammar_tokenizer(tokenizer, VOCAB, [eos]) is gtok
    assert grammar_tokenizer(tokenizer, VOCAB + 32, [eos]) is not gtok
    g = json_schema_grammar(PERSON)
    a, b = gtok.matcher(g), gtok.matcher(g)
    assert a._m is not b._m  # copies of one compiled template


def test_sampling_params_grammar_validation():
    SamplingParams(grammar=regex_grammar("a")).validate()
    with pytest.raises(SamplingParamsError, match="grammar"):
        SamplingParams(grammar="  ").validate()


# -- the engine ----------------------------------------------------------------------------------


def test_engine_json_schema_outputs_validate(tokenizer, eos):
    engine = make_engine(tokenizer, eos)
    g = json_schema_grammar(PERSON)
    params = [SamplingParams(max_tokens=600, temperature=1.0, seed=s, grammar=g) for s in range(6)]
    for res in run(engine, [[5, 6, 7]] * 6, params):
        text, _, reason = res[0]
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert not engine.scheduler.has_work()


def test_engine_n_forks_clone_matchers(tokenizer, eos):
    engine = make_engine(tokenizer, eos)
    g = regex_grammar(r"[a-z]{2,6}-[0-9]{1,3}")
    (res,) = run(engine, [[9, 8, 7]], [SamplingParams(max_tokens=40, seed=3, n=4, grammar=g)])
    assert len(res) == 4
    for text, _, reason in res.values():
        assert reason == "stop" and re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}", text), text
    assert len({text for text, _, _ in res.values()}) > 1


def test_engine_preemption_keeps_matchers_right(tokenizer, eos):
    # Few pages: the running sequences preempt each other and resume by recompute.
    engine = make_engine(tokenizer, eos, num_pages=12, max_num_batched_tokens=64)
    g = json_schema_grammar({"type": "array", "items": {"type": "integer"}, "minItems": 8})
    params = [SamplingParams(max_tokens=150, seed=s, grammar=g) for s in range(4)]
    prompts = [[3 + s] * 20 for s in range(4)]
    batched = run(engine, prompts, params)
    assert engine.stats().num_preemptions > 0
    for s, res in enumerate(batched):
        text, ids, reason = res[0]
        assert reason == "stop", text
        assert len(json.loads(text)) >= 8
        alone = run(make_engine(tokenizer, eos), [prompts[s]], [params[s]])[0]
        assert alone[0][1] == ids


def test_engine_batch_mixed_equals_alone(tokenizer, eos):
    schema = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}
    params = [
        SamplingParams(max_tokens=200, seed=1, grammar=json_schema_grammar(schema)),
        SamplingParams(max_tokens=30, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=30, seed=3, grammar=choice_grammar(["alpha", "beta", "gamma"])),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=50, seed=4, grammar=regex_grammar(r"\d+(\.\d+)?"), n=2),
    ]
    prompts = [[10 + i, 20, 30] for i in range(len(params))]
    batched = run(make_engine(tokenizer, eos), prompts, params)
    for i, p in enumerate(params):
        assert run(make_engine(tokenizer, eos), [prompts[i]], [p])[0] == batched[i]
    assert batched[2][0][0] in {"alpha", "beta", "gamma"}


def test_engine_overlap_and_sequential_masks_agree(tokenizer, eos):
    g = json_schema_grammar(PERSON)
    params = [SamplingParams(max_tokens=400, seed=s, grammar=g) for s in range(4)]
    outs = []
    for overlap in (True, False):
        engine = make_engine(tokenizer, eos)
        engine.overlap_masks = overlap
        outs.append(run(engine, [[1, 2, 3]] * 4, params))
    assert outs[0] == outs[1]


def test_engine_dead_end_and_empty_grammars(tokenizer, eos):
    engine = make_engine(tokenizer, eos)
    params = [
        SamplingParams(max_tokens=20, grammar=regex_grammar(r"a[^\s\S]")),  # dead at once
        SamplingParams(max_tokens=20, grammar=lark_grammar('start: ""')),  # empty sentence
        SamplingParams(max_tokens=20, seed=1, ignore_eos=True),  # unaffected neighbour
    ]
    res = run(engine, [[4, 5], [4, 6], [4, 7]], params)
    assert res[0][0] == ("", [], "grammar_error")
    assert res[1][0] == ("", [], "stop")
    assert res[2][0][2] == "length" and len(res[2][0][1]) == 20
    assert not engine.scheduler.has_work()


def test_engine_dead_end_mid_way(tokenizer, eos):
    # After "ab" the grammar wants the EOS token itself, which ignore_eos keeps out of the
    # mask: nothing is allowed, a dead end after two tokens. A neighbour is not affected.
    engine = make_engine(tokenizer, eos)
    g = lark_grammar(f'start: "ab" <[{eos}]> "cd"')
    params = [
        SamplingParams(max_tokens=20, seed=1, grammar=g, ignore_eos=True),
        SamplingParams(max_tokens=20, seed=1, ignore_eos=True),
    ]
    res = run(engine, [[4, 5], [4, 5]], params)
    assert (res[0][0][0], res[0][0][2]) == ("ab", "grammar_error")
    assert res[1][0][2] == "length" and len(res[1][0][1]) == 20
    assert not engine.scheduler.has_work() and engine.stats().num_running == 0


def test_engine_ignore_eos_keeps_going_while_grammar_allows(tokenizer, eos):
    engine = make_engine(tokenizer, eos)
    g = regex_grammar(r"[0-9]{1,40}")
    res = run(
        engine,
        [[4, 5]] * 3,
        [SamplingParams(max_tokens=100, seed=s, grammar=g, ignore_eos=True) for s in range(3)],
    )
    for r in res:
        text, ids, reason = r[0]
        assert reason == "stop" and re.fullmatch(r"[0-9]{1,40}", text)
        assert eos not in ids
        assert len(text) == 40  # EOS was never allowed, so only the grammar's end stops it


def test_engine_rejects_bad_grammar_at_submit(tokenizer, eos):
    engine = make_engine(tokenizer, eos)
    with pytest.raises(GrammarError, match="unclosed group"):
        engine.submit([1, 2], SamplingParams(grammar=regex_grammar("a(b")), lambda _: None)
    assert not engine._has_work()
    no_tok = Engine(FakeModelRunner(vocab_size=VOCAB))
    with pytest.raises(ValueError, match="tokenizer"):
        no_tok.submit([1, 2], SamplingParams(grammar=regex_grammar("a")), lambda _: None)


def test_engine_logprobs_and_stop_strings_with_grammar(tokenizer, eos):
    engine = make_engine(tokenizer, eos)
    g = regex_grammar(r"[a-z]{10}")
    p = SamplingParams(max_tokens=30, seed=2, grammar=g, logprobs=True, top_logprobs=3)
    outs = engine.generate([[4, 5]], [p])[0]
    lps = [lp for o in outs for d in o.outputs for lp in (d.logprobs or [])]
    assert lps and all(lp.logprob <= 0 and len(lp.top_logprobs) <= 3 for lp in lps)
    assert all(np.isfinite(v) for lp in lps for _, v in lp.top_logprobs)
