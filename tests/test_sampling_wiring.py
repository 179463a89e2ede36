"""Each sampling field, sent through the official `openai` client to a live server over the fake
runner, checked by its *effect* on the output against an oracle computed here with numpy from
the runner's `reference_logits` (issue 24: a server that dropped `top_k` passed every test).

The fake's tokenizer is word-level (`w<id>`), so output text maps back to token ids exactly.
"""

from __future__ import annotations

import re

import numpy as np
import openai
import pytest
from server_helpers import MODEL, serve_engine  # noqa: I001
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from tallow.runtime.artifact import TokenizerBundle
from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server.app import ServerOptions

V = 101
REPEAT = 7  # the token the repetitive runner favours
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


class RepetitiveRunner(FakeModelRunner):
    """The fake's logits with REPEAT one above the best other token: greedy output is REPEAT
    again and again, so the penalties have something to push against."""

    def _logits(self, history: list[int]) -> np.ndarray:
        out = super()._logits(history)
        out[REPEAT] = np.delete(out, REPEAT).max() + 1.0
        return out


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    return tok


def _start(runner_class):
    tok = _tokenizer()
    runner = runner_class(vocab_size=V, context_window=1024, num_pages=512)
    # A chat template so /v1/chat/completions works; no EOS: outputs run to their limit.
    runner.tokenizer = TokenizerBundle(
        tokenizer=tok,
        bos_token_id=None,
        eos_token_ids=[],
        add_bos_token=False,
        chat_template=TEMPLATE,
        bos_token=None,
        eos_token=None,
    )
    engine = Engine(
        runner,
        tokenizer=tok,
        eos_token_ids=(),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512),
    )
    server = serve_engine(engine, ServerOptions())
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    return server, runner, client


@pytest.fixture(scope="module")
def fake():
    server, runner, client = _start(FakeModelRunner)
    yield runner, client
    server.stop()


@pytest.fixture(scope="module")
def repetitive():
    server, runner, client = _start(RepetitiveRunner)
    yield runner, client
    server.stop()


def ids(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"w(\d+)", text)]


def oracle(runner, prompt, n, edit=None) -> list[int]:
    """Greedy continuation of `prompt`; `edit(logits, prompt, output)` changes each step's
    float32 logits in place first (a penalty or a bias, by its formula)."""
    out: list[int] = []
    for _ in range(n):
        logits = runner.reference_logits(prompt + out).astype(np.float32)
        if edit is not None:
            edit(logits, prompt, out)
        out.append(int(np.argmax(logits)))
    return out


def complete(client, tokens=8, prompt=PROMPT, **kw):
    extra = {k: kw.pop(k) for k in list(kw) if k in ("top_k", "min_p", "stop_token_ids")}
    extra |= {k: kw.pop(k) for k in list(kw) if k == "repetition_penalty"}
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=tokens, extra_body=extra or None, **kw
    )


def test_top_k_1_equals_greedy(fake):
    runner, client = fake
    greedy = oracle(runner, PROMPT, 8)
    assert ids(complete(client, temperature=0.0).choices[0].text) == greedy
    # The same seeded sampling without the cut is not greedy: the check below can fail.
    free = [ids(complete(client, temperature=1.5, seed=s).choices[0].text) for s in (1, 2)]
    assert any(f != greedy for f in free)
    for s in (1, 2):
        got = complete(client, temperature=1.5, seed=s, top_k=1).choices[0].text
        assert ids(got) == greedy


def test_min_p_near_one_equals_greedy(fake):
    runner, client = fake
    greedy = oracle(runner, PROMPT, 8)
    for s in (1, 2):
        got = complete(client, temperature=1.5, seed=s, min_p=0.999).choices[0].text
        assert ids(got) == greedy


def test_logit_bias_forces_and_bans(fake):
    runner, client = fake
    greedy = oracle(runner, PROMPT, 6)
    forced = next(t for t in range(V) if t not in greedy)
    got = complete(client, 6, temperature=0.0, logit_bias={str(forced): 100})
    assert ids(got.choices[0].text) == [forced] * 6
    banned = greedy[0]

    def ban(logits, _p, _o):
        logits[banned] -= 100.0

    got = ids(complete(client, 6, temperature=0.0, logit_bias={str(banned): -100}).choices[0].text)
    assert banned not in got and got == oracle(runner, PROMPT, 6, ban)
    # Sampling too: a banned token never comes out.
    got = complete(client, 12, temperature=1.5, seed=5, logit_bias={str(banned): -100})
    assert banned not in ids(got.choices[0].text)


def test_stop_token_ids_stop_with_stop_and_leave_the_token_out(fake):
    runner, client = fake
    greedy = oracle(runner, PROMPT, 12)
    k = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])
    res = complete(client, 12, temperature=0.0, stop_token_ids=[greedy[k]])
    choice = res.choices[0]
    assert choice.finish_reason == "stop"
    assert ids(choice.text) == greedy[:k] and greedy[k] not in ids(choice.text)
    assert res.usage.completion_tokens in (k, k + 1)  # the stop token may count as generated


def _counts(out):
    return np.bincount(np.asarray(out, dtype=np.int64), minlength=V).astype(np.float32)


@pytest.mark.parametrize(
    "field, value",
    [("frequency_penalty", 1.5), ("presence_penalty", 2.0), ("repetition_penalty", 2.5)],
)
def test_penalties_follow_their_formulas(repetitive, field, value):
    runner, client = repetitive
    n = 10
    plain = oracle(runner, PROMPT, n)
    assert plain == [REPEAT] * n  # the unpenalized output repeats

    def penalize(logits, prompt, out):
        c = _counts(out)
        if field == "frequency_penalty":  # OpenAI: mu[j] -= c[j] * alpha_frequency
            logits -= c * np.float32(value)
        elif field == "presence_penalty":  # OpenAI: mu[j] -= (c[j] > 0) * alpha_presence
            logits -= (c > 0) * np.float32(value)
        else:  # HF/vLLM: seen tokens (prompt and output), positive / p, negative * p
            seen = (_counts(prompt) + c) > 0
            pen = np.float32(value)
            logits[:] = np.where(seen, np.where(logits > 0, logits / pen, logits * pen), logits)

    expected = oracle(runner, PROMPT, n, penalize)
    assert expected != plain  # the penalty changes the output, so ignoring it fails below
    got = complete(client, n, temperature=0.0, **{field: value}).choices[0].text
    assert ids(got) == expected


def test_max_completion_tokens_caps_the_chat_output(fake):
    runner, client = fake
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    res = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0.0, max_completion_tokens=5, max_tokens=20
    )
    choice = res.choices[0]
    assert choice.finish_reason == "length" and res.usage.completion_tokens == 5
    assert ids(choice.message.content) == oracle(runner, [5, 6, 7], 5)


def test_seed_reproduces(fake):
    _, client = fake
    runs = [ids(complete(client, 12, temperature=1.5, seed=s).choices[0].text) for s in (9, 9)]
    assert runs[0] == runs[1] and len(runs[0]) == 12
    others = [ids(complete(client, 12, temperature=1.5, seed=s).choices[0].text) for s in (10, 11)]
    assert any(o != runs[0] for o in others)


def test_n_gives_n_choices(fake):
    runner, client = fake
    res = complete(client, 6, temperature=1.5, seed=4, n=3)
    assert sorted(c.index for c in res.choices) == [0, 1, 2]
    outs = [ids(c.text) for c in sorted(res.choices, key=lambda c: c.index)]
    assert all(len(o) == 6 for o in outs) and len({tuple(o) for o in outs}) > 1
    greedy = complete(client, 6, temperature=0.0, n=3)
    assert [ids(c.text) for c in greedy.choices] == [oracle(runner, PROMPT, 6)] * 3
