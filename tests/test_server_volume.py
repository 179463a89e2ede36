"""Volume from a hostile but legitimate client (issue 33): no request stalls the event loop,
answers 500 for the client's mistake, keeps running once its client left, or locks others out;
and requests the docs promise work (a large `guided_choice`, `echo` without logprobs).

Over the fake runner with the tiny Qwen-style tokenizer (grammars work), in this process. The
event-loop tests hold a request inside its preparation at a gate (no timing): while it waits
there, `/health` and a running stream must still be served.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from scripted_server import QWEN_TOOL_TEMPLATE, make_bundle
from server_helpers import MODEL, serve_engine  # noqa: I001

from tallow.runtime import constraint
from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.scheduler import SchedulerConfig
from tallow.runtime.served_model import ServedModel
from tallow.server import context as server_context
from tallow.server.app import ServerOptions
from tallow.server.context import MAX_JSON_DEPTH

CHAT = [{"role": "user", "content": "The capital of France is"}]
MARK = "HOLD-AT-THE-GATE"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("qwen"), QWEN_TOOL_TEMPLATE)


def make_server(bundle, max_num_seqs: int = 8, **options):
    tok = bundle.tokenizer
    runner = FakeModelRunner(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        context_window=1024,
        num_pages=512,
        hidden_size=8,
    )
    runner.tokenizer = bundle
    engine = Engine(
        runner,
        tokenizer=tok,
        eos_token_ids=bundle.eos_token_ids,
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
    )
    return serve_engine(engine, ServerOptions(**options))


@pytest.fixture(scope="module")
def server(bundle):
    s = make_server(bundle)
    yield s
    s.stop()


def chat(base: str, timeout: float = 60, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=timeout)


# -- nothing heavy on the event loop ---------------------------------------------------------


class Gate:
    """Holds whoever calls `pass_through` until `open` (or 30 s, so a broken build fails the
    test instead of hanging it)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()

    def pass_through(self) -> None:
        self.entered.set()
        self._open.wait(30)

    def open(self) -> None:
        self._open.set()


def _gated(monkeypatch, gate: Gate) -> None:
    """Every preparation step a request's size can make slow holds at `gate` when the request
    carries MARK: parsing the body, tokenizing (text and chat), compiling a grammar."""
    parse, encode, encode_chat = (
        server_context.parse_json,
        ServedModel.encode_text,
        ServedModel._encode_template_text,
    )
    matcher = constraint.GrammarTokenizer.matcher

    def parse_json(raw: bytes):
        if MARK.encode() in raw and b"parse" in raw:
            gate.pass_through()
        return parse(raw)

    def encode_text(self, text, *args, **kwargs):
        if MARK in text:
            gate.pass_through()
        return encode(self, text, *args, **kwargs)

    def encode_template_text(self, text):
        if MARK in text:
            gate.pass_through()
        return encode_chat(self, text)

    def compile_grammar(self, grammar):
        if MARK in grammar:
            gate.pass_through()
        return matcher(self, grammar)

    monkeypatch.setattr(server_context, "parse_json", parse_json)
    monkeypatch.setattr(ServedModel, "encode_text", encode_text)
    monkeypatch.setattr(ServedModel, "_encode_template_text", encode_template_text)
    monkeypatch.setattr(constraint.GrammarTokenizer, "matcher", compile_grammar)


HELD = {
    "parse": ("/v1/chat/completions", {"messages": CHAT, "user": MARK + " parse"}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": MARK}]}),
    "completion": ("/v1/completions", {"prompt": MARK}),
    "responses": ("/v1/responses", {"input": MARK}),
    "embeddings": ("/v1/embeddings", {"input": [MARK, "x"]}),
    "tokenize": ("/tokenize", {"prompt": MARK}),
    "grammar": ("/v1/chat/completions", {"messages": CHAT, "guided_choice": [MARK, "no"]}),
}


@pytest.mark.parametrize("what", list(HELD))
def test_a_request_held_in_preparation_blocks_nobody(server, monkeypatch, what):
    gate = Gate()
    _gated(monkeypatch, gate)
    base = server.base_url
    route, extra = HELD[what]
    held: dict = {}

    def send() -> None:
        body = {"model": MODEL, "max_tokens": 2, **extra}
        held["r"] = httpx.post(base + route, json=body, timeout=60)

    stream_body = {"model": MODEL, "messages": CHAT, "max_tokens": 30, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json={**stream_body, "stream": True}, timeout=60
    ) as stream:
        lines: Iterator[str] = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        sender = threading.Thread(target=send)
        sender.start()
        try:
            assert gate.entered.wait(30), "the request never reached its preparation"
            # The loop is free: /health answers and the stream runs to its end, while the
            # request is still held.
            assert httpx.get(f"{base}/health", timeout=20).status_code == 200
            rest = [line for line in lines if line.startswith("data: ")]
            assert not gate._open.is_set()
        finally:
            gate.open()
            sender.join(60)
    assert rest[-1] == "data: [DONE]" and json.loads(first[6:])["choices"]
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert held["r"].status_code == 200, held["r"].text


# -- nesting -----------------------------------------------------------------------------------


def nested(depth: int) -> dict | list:
    """A JSON value `depth` levels deep (objects and arrays alternating)."""
    value: dict | list = {}
    for i in range(depth - 1):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth", [475, 5000])
def test_deep_nesting_is_a_400_naming_the_limit(server, depth):
    """Past Python's recursion limit too (5,000), so the body is written as text here."""
    base = server.base_url
    deep = "[" * depth + "]" * depth
    parameters = {"type": "object", "properties": {"a": "DEEP"}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    bodies = [
        {"chat_template_kwargs": {"x": "DEEP"}},
        {"tools": [tool], "tool_choice": "required"},
    ]
    for extra in bodies:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **extra}
        text = json.dumps(body).replace('"DEEP"', deep)
        r = httpx.post(
            f"{base}/v1/chat/completions",
            content=text,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "nesting_too_deep" and str(MAX_JSON_DEPTH) in error["message"]
    assert chat(base).status_code == 200


def test_a_body_at_the_nesting_limit_is_served(server):
    # body (1) > chat_template_kwargs (2) > x (3) ... : MAX_JSON_DEPTH levels in all
    r = chat(server.base_url, chat_template_kwargs={"x": nested(MAX_JSON_DEPTH - 2)})
    assert r.status_code == 200, r.text
    r = chat(server.base_url, chat_template_kwargs={"x": nested(MAX_JSON_DEPTH - 1)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "nesting_too_deep"


# -- prompts that cannot fit -------------------------------------------------------------------


def test_a_prompt_too_long_by_its_length_is_refused_before_tokenizing(server, monkeypatch):
    model: ServedModel = server.engine.model
    limit = model.context_window * model.max_token_chars
    seen: list[int] = []
    encode = ServedModel._encode_template_text
    monkeypatch.setattr(
        ServedModel,
        "_encode_template_text",
        lambda self, text: seen.append(len(text)) or encode(self, text),
    )
    huge = [{"role": "user", "content": "ab" * (limit // 2 + 1)}]
    r = chat(server.base_url, messages=huge)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert all(n < limit for n in seen)
    body = {"model": MODEL, "prompt": "ab" * (limit // 2 + 1), "max_tokens": 1}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# -- embeddings --------------------------------------------------------------------------------


class HiddenGate:
    """Holds the runner's hidden-state forwards after the first `n` until opened."""

    def __init__(self, runner, n: int) -> None:
        self.real, self.n = runner.forward_hidden, n
        self.held = threading.Event()
        self._open = threading.Event()
        runner.forward_hidden = self._forward

    def _forward(self, items):
        self.n -= 1
        if self.n < 0:
            self.held.set()
            self._open.wait(120)
        return self.real(items)

    def open(self) -> None:
        self._open.set()


def _wait_idle(engine) -> None:
    for _ in range(600):
        s = engine.stats()
        if s.num_waiting == 0 and s.num_running == 0 and not engine._inbox.has_pending():
            return
        threading.Event().wait(0.05)
    raise AssertionError("the engine did not become idle")


def test_an_abandoned_embeddings_request_stops(bundle, caplog):
    # what earlier tests in this worker left for the collector (an HTTP client's close task
    # on a loop that is gone) logs "never retrieved" when collected: collect it first, so
    # the check below sees only this test's futures
    gc.collect()
    caplog.clear()
    s = make_server(bundle)
    try:
        runner = s.engine.runner
        gate = HiddenGate(runner, 1)
        inputs = [[5, 6, 7, 8]] * 32
        body = json.dumps({"model": MODEL, "input": inputs}).encode()
        host, port = s.base_url.removeprefix("http://").split(":")
        # The client leaves once its request is being embedded (held at the gate), however
        # long a loaded machine takes to get there (a 2 s client timeout raced it).
        with socket.create_connection((host, int(port)), timeout=60) as client:
            client.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert gate.held.wait(120), "the request never reached the runner"
        gate.open()
        _wait_idle(s.engine)
        embedded = sum(len(items) for items in runner.hidden_log)
        assert embedded < len(inputs), "every input was embedded after the client left"
        gc.collect()  # the aborted inputs' futures: their errors were read, nothing is logged
        unread = [
            r.getMessage()
            for r in caplog.records
            if "never retrieved" in r.getMessage() and "AsyncClient" not in r.getMessage()
        ]
        assert not unread, unread
        r = httpx.post(f"{s.base_url}/v1/embeddings", json={"input": "x"}, timeout=60)
        assert r.status_code == 200
    finally:
        s.stop()


def test_a_large_embeddings_request_does_not_lock_others_out(bundle):
    s = make_server(bundle, max_queued_requests=64)
    try:
        gate = HiddenGate(s.engine.runner, 1)
        inputs = [[5, 6, 7]] * 2048
        done: dict = {}

        def embed() -> None:
            body = {"model": MODEL, "input": inputs}
            done["r"] = httpx.post(f"{s.base_url}/v1/embeddings", json=body, timeout=120)

        embedding = threading.Thread(target=embed)
        embedding.start()
        assert gate.held.wait(30)
        results: list = [None] * 12
        state = s.app.state.context.state

        def one(i: int) -> None:
            results[i] = chat(s.base_url, timeout=120)

        chats = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in chats:
            t.start()
        # Admitted (counted as queued) or refused (a 429 arrives at once): wait for either.
        for _ in range(600):
            if state.queued >= 2 * 8 + 12 or any(r is not None for r in results):
                break
            threading.Event().wait(0.05)
        gate.open()
        for t in [*chats, embedding]:
            t.join(120)
        assert [r.status_code for r in results] == [200] * 12
        body = done["r"].json()
        assert len(body["data"]) == 2048
        v = np.array(body["data"][-1]["embedding"])
        ref = FakeModelRunner(hidden_size=8).reference_hidden([5, 6, 7]).mean(axis=0)
        np.testing.assert_allclose(v, ref / np.linalg.norm(ref), atol=1e-6)
        assert state.queued == 0
    finally:
        s.stop()


# -- grammars and echo -------------------------------------------------------------------------


def test_a_guided_choice_of_thousands_of_options_completes(server):
    options = [f"option number {i}" for i in range(2500)]
    r = chat(server.base_url, guided_choice=options, max_tokens=40, temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] in options


def test_echo_without_logprobs_returns_the_prompt(server, bundle):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    (c,) = r.choices
    assert (c.text, c.finish_reason, c.logprobs) == (prompt, "length", None)
    n = len(bundle.tokenizer.encode(prompt).ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, 0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=[prompt, "x"], max_tokens=0, echo=True, n=2, stream=True
        )
    )
    texts: dict[int, str] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {0: prompt, 1: prompt, 2: "x", 3: "x"}


# -- tokenizing without the GIL ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["text", "chat"])
def test_tokenizing_a_long_prompt_lets_other_threads_run(bundle, how):
    """`tokenizers`' `encode` holds the GIL throughout; on a worker thread a 3.6 MB prompt
    still stopped the event loop for seconds. The main thread must keep running meanwhile."""
    model = ServedModel("tiny", bundle.tokenizer, 400, 1 << 30, frozenset(bundle.eos_token_ids))
    text = "the capital of France is Paris, " * 60_000  # about 2 MB
    for _ in range(2):  # the first encode of a thread can behave otherwise
        worker = threading.Thread(
            target=model.encode_text if how == "text" else model._encode_template_text,
            args=(text,),
        )
        worker.start()
        ticks = 0
        while worker.is_alive():
            threading.Event().wait(0.001)
            ticks += 1
        assert ticks >= 10, f"the main thread ran {ticks} times while {how} was tokenized"


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e300])
def test_extreme_repetition_penalties_answer_in_valid_json(server, penalty):
    """A valid but extreme penalty once made a logit infinite, a logprob -inf, and the answer
    unwritable as JSON (a 500, found by the fuzz campaign)."""
    body = {
        "model": MODEL,
        "prompt": "the capital the capital",
        "max_tokens": 3,
        "logprobs": 2,
        "repetition_penalty": penalty,
    }
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["logprobs"]
    values = lps["token_logprobs"] + [v for top in lps["top_logprobs"] for v in top.values()]
    assert values and all(-9999.0 <= v <= 0.0 for v in values)


def test_an_internal_error_closes_its_connection_openly(server, monkeypatch):
    """After an unhandled error Starlette re-raises and uvicorn drops the connection; the
    500 says `Connection: close`, so a keep-alive client does not send into a dead socket."""
    from tallow.server.routes import chat as chat_route

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(chat_route, "chat_inputs", broken)
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and r.headers["connection"] == "close"
        assert r.json()["error"]["code"] == "internal_error"
        monkeypatch.undo()
        assert client.post("/v1/chat/completions", json=body).status_code == 200
