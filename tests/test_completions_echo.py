"""`echo`, prompt logprobs and `priority` on the API, through the official `openai` client, over
a live server on the fake runner with the tiny byte-level BPE tokenizer. Logprobs are checked
against a numpy log-softmax of the fake's `reference_logits` for exactly that prefix; offsets
against the returned text."""

from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import openai
import pytest
from server_helpers import MODEL, serve_engine, tiny_tokenizer_bundle

from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server.app import ServerOptions

V = 320
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    bundle = tiny_tokenizer_bundle(tmp_path_factory.mktemp("tok"), V)
    runner = FakeModelRunner(vocab_size=V, context_window=1024, num_pages=512, page_size=16)
    runner.tokenizer = bundle
    engine = Engine(
        runner,
        tokenizer=bundle.tokenizer,
        eos_token_ids=bundle.eos_token_ids,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=16
        ),
    )
    server = serve_engine(engine, ServerOptions())
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    yield server, runner, bundle.tokenizer, client
    server.stop()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def check_prompt_logprobs(lp, ids: list[int], tok, runner, top: int) -> None:
    ref = FakeModelRunner(vocab_size=V)
    n = len(ids)
    assert lp.tokens[:n] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        expect = log_softmax(ref.reference_logits(ids[:i]))
        assert lp.token_logprobs[i] == pytest.approx(expect[ids[i]], abs=1e-5)
        best = np.argsort(-expect, kind="stable")[:top]
        want = {tok.decode([int(t)], skip_special_tokens=False): expect[t] for t in best}
        assert lp.top_logprobs[i] == pytest.approx(want, abs=1e-5)


def check_offsets(text: str, lp) -> None:
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        if offset < len(text):  # a stop token's text is not in the choice's text
            assert text[offset : offset + len(token)] == token


def test_echo_with_max_tokens_zero_scores_the_prompt(live):
    _, runner, tok, client = live
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    (c,) = r.choices
    ids = tok.encode(PROMPT).ids
    assert c.text == PROMPT and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids)
    check_prompt_logprobs(c.logprobs, ids, tok, runner, 2)
    check_offsets(c.text, c.logprobs)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0


def test_echo_with_generation_lists_prompt_then_completion(live):
    _, runner, tok, client = live
    ids = tok.encode(PROMPT).ids
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, logprobs=1)
    plain = client.completions.create(**kw).choices[0]
    r = client.completions.create(echo=True, **kw).choices[0]
    assert r.text == PROMPT + plain.text
    lp = r.logprobs
    assert len(lp.tokens) == len(ids) + len(plain.logprobs.tokens)
    check_prompt_logprobs(lp, ids, tok, runner, 1)
    assert lp.token_logprobs[len(ids) :] == plain.logprobs.token_logprobs
    assert lp.text_offset[len(ids)] == len(PROMPT)
    check_offsets(r.text, lp)
    # echo without logprobs: just the text
    r = client.completions.create(echo=True, **{**kw, "logprobs": None}).choices[0]
    assert r.text == PROMPT + plain.text and r.logprobs is None


def test_echo_of_token_ids_and_of_several_prompts(live):
    _, runner, tok, client = live
    prompts = [tok.encode(p).ids for p in ("a b c d", "hello there world")]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=0)
    assert [c.text for c in r.choices] == [tok.decode(p) for p in prompts]
    for c, ids in zip(r.choices, prompts, strict=True):
        check_prompt_logprobs(c.logprobs, ids, tok, runner, 0)


def test_streamed_echo_equals_the_whole_body(live):
    _, _, _, client = live
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.0, logprobs=1, echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        joined = [x for c in chunks if c.logprobs for x in getattr(c.logprobs, field)]
        assert joined == getattr(whole.logprobs, field), field


def test_the_stop_token_is_listed_last(live):
    # What lm-evaluation-harness relies on: with max_tokens 1 the last entry is the one
    # sampled token, even when it is a stop token (its text is not in the choice's text).
    _, runner, tok, client = live
    ids = tok.encode(PROMPT).ids
    first = int(np.argmax(FakeModelRunner(vocab_size=V).reference_logits(ids)))
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0.0, logprobs=1, echo=True)
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [first]}).choices[0]
    assert r.finish_reason == "stop" and r.text == PROMPT
    assert len(r.logprobs.tokens) == len(ids) + 1
    assert r.logprobs.tokens[-1] == tok.decode([first], skip_special_tokens=False)
    expect = log_softmax(FakeModelRunner(vocab_size=V).reference_logits(ids))[first]
    assert r.logprobs.token_logprobs[-1] == pytest.approx(expect, abs=1e-5)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 0}, "max_tokens"),  # without echo
        ({"echo": True, "logprobs": 21}, "logprobs"),
        ({"echo": True, "logprobs": -1}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"priority": "high"}, "priority"),
        ({"priority": 2**31}, "priority"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ],
)
def test_bad_values_are_400s_naming_the_field(live, body, param):
    server = live[0]
    url = f"{server.base_url}/v1/completions"
    r = httpx.post(url, json={"model": MODEL, "prompt": PROMPT, **body}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = httpx.post(url, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200


# -- priority ------------------------------------------------------------------------------


def test_a_higher_priority_request_is_served_first(live):
    """Three requests wait behind a running one on an engine with one sequence slot: the one
    with the lowest `priority` value starts first, whatever the arrival order."""
    server, runner, tok, client = live
    engine = server.engine
    real, gate = runner.forward, threading.Event()
    started: list[str] = []

    def gated(items):
        for _, tokens in items:
            if len(tokens) > 1:  # a (whole) prompt's prefill: which request starts
                started.append(tok.decode(tokens))
        if len(started) == 1:
            gate.wait(30)  # hold the first request's step until the others are queued
        return real(items)

    runner.forward = gated
    saved = engine.scheduler.max_num_seqs
    engine.scheduler.max_num_seqs = 1
    aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="x", max_retries=0)

    async def one(prompt: str, priority: int | None) -> None:
        extra = {} if priority is None else {"priority": priority}
        await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)

    async def main():
        first = asyncio.create_task(one("first one", None))
        while not started:
            await asyncio.sleep(0.01)
        rest = [
            asyncio.create_task(one(p, prio))
            for p, prio in (("late low", 5), ("late default", None), ("late urgent", -3))
        ]
        while server.app.state.tallow.queued < 4:  # the first, and three behind it
            await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(first, *rest)

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        gate.set()
        runner.forward = real
        engine.scheduler.max_num_seqs = saved
    assert started == ["first one", "late urgent", "late default", "late low"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_priority_on_chat_and_responses(live, route):
    server = live[0]
    url = f"{server.base_url}{route}"
    if route.endswith("responses"):
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    engine = server.engine
    seen: list[int] = []
    real = engine.add_request

    def recording(prompt, params, *args, **kw):
        seen.append(params.priority)
        return real(prompt, params, *args, **kw)

    engine.add_request = recording
    try:
        assert httpx.post(url, json={**body, "priority": -7}, timeout=10).status_code == 200
        assert httpx.post(url, json=body, timeout=10).status_code == 200
    finally:
        del engine.add_request
    assert seen == [-7, 0]  # what reaches the engine
    for bad in (2**31, "1", 1.5):
        r = httpx.post(url, json={**body, "priority": bad}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
