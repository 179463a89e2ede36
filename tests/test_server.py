"""`tallow serve` end to end: the official openai client against a live uvicorn server on the
tiny compiled qwen3 artifact (vocab 320, context 256, random weights, so texts are gibberish
but deterministic under greedy decoding)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from server_helpers import (  # noqa: I001
    MODEL,
    ForwardGate,
    metric,
    start_server,
    start_subprocess,
    wait_until_draining,
)

from tallow.server.app import ServerOptions
from tallow.server.context import ServerState

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "The capital of France is"}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    return tiny_artifact("qwen3")


@pytest.fixture(scope="module")
def server(artifact):
    opts = ServerOptions(api_key=KEY, max_body_bytes=64 * 1024)
    s = start_server(artifact, opts, max_num_seqs=16, prefill_chunk_size=256, kv_cache_mem_mb=8)
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)


def greedy(**kw):
    return {"model": MODEL, "temperature": 0.0, "ignore_eos": True, "max_tokens": 12, **kw}


def extra(**kw):
    """Sampling fields the openai client has no argument for go through extra_body."""
    body = greedy(**kw)
    named = {k: body.pop(k) for k in ("model", "temperature", "max_tokens") if k in body}
    return {**named, "extra_body": body}


# -- happy paths ---------------------------------------------------------------------------------


def test_chat_and_completion_basic(client):
    r = client.chat.completions.create(messages=CHAT, **extra())
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    c = client.completions.create(prompt="The quick brown fox", **extra())
    assert c.object == "text_completion" and c.choices[0].finish_reason == "length"
    assert c.usage.total_tokens == c.usage.prompt_tokens + 12
    # Multi-turn, list-of-parts content, system message.
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again"},
    ]
    assert client.chat.completions.create(messages=msgs, **extra()).choices[0].message.content
    # Token-id prompts and batches of prompts: one choice per prompt (times n).
    b = client.completions.create(prompt=[[5, 6, 7], [8, 9]], n=2, **extra())
    assert [ch.index for ch in b.choices] == [0, 1, 2, 3]
    assert b.choices[0].text == b.choices[1].text  # greedy siblings agree
    assert client.models.list().data[0].id == MODEL


def test_streaming_matches_non_streaming(client):
    full = client.chat.completions.create(messages=CHAT, **extra())
    chunks = list(
        client.chat.completions.create(
            messages=CHAT, stream=True, stream_options={"include_usage": True}, **extra()
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    comp = list(client.completions.create(prompt="abc", stream=True, **extra(max_tokens=5)))
    assert all(c.object == "text_completion" for c in comp) and comp[-1].choices[0].finish_reason


def test_n2_stop_logprobs_seed(client):
    r = client.chat.completions.create(
        messages=CHAT, n=2, logprobs=True, top_logprobs=3, **extra(temperature=1.0, seed=7)
    )
    assert {c.index for c in r.choices} == {0, 1}
    lp = r.choices[0].logprobs.content
    assert len(lp) == 12 and len(lp[0].top_logprobs) == 3 and lp[0].logprob <= 0
    again = client.chat.completions.create(messages=CHAT, n=2, **extra(temperature=1.0, seed=7))
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # Completions' legacy logprobs shape.
    c = client.completions.create(prompt="The", logprobs=2, **extra(max_tokens=4))
    assert (
        len(c.choices[0].logprobs.tokens) == 4 and len(c.choices[0].logprobs.top_logprobs[0]) == 2
    )
    # A stop string cut from the greedy text: the completion ends before it.
    base = client.completions.create(prompt="The", **extra(max_tokens=30)).choices[0].text
    stop = base[len(base) // 2 :][:3]
    if stop.strip():
        s = client.completions.create(prompt="The", stop=[stop], **extra(max_tokens=30))
        assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].text
        assert base.startswith(s.choices[0].text)


def test_tokenize_detokenize_metrics_health(server):
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hello"}, headers=AUTH).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids["tokens"]}, headers=AUTH)
    assert "hello" in text.json()["prompt"]
    chat = httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT}, headers=AUTH).json()
    assert chat["count"] > ids["count"]
    body = httpx.get(f"{server.base_url}/metrics", headers=AUTH).text
    for name in (
        "tallow_kv_cache_pages_used",
        "tallow_num_requests_waiting",
        "tallow_time_to_first_token_seconds_bucket",
        "tallow_generation_tokens_total",
        "tallow_preemptions_total",
        "tallow_prefix_cache_hit_tokens_total",
        "tallow_step_latency_avg_seconds",
        "tallow_request_latency_seconds_count",
    ):
        assert name in body
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# -- bad input -----------------------------------------------------------------------------------

BAD = [
    # (body or raw bytes, status, code)
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_request"),
    ({"model": MODEL, "messages": []}, 400, "invalid_value"),
    ({"model": MODEL}, 400, "missing_parameter"),
    ({"model": MODEL, "messages": "hi"}, 400, "invalid_type"),
    ({"model": MODEL, "messages": CHAT, "temperature": "hot"}, 400, "invalid_type"),
    ({"model": MODEL, "messages": CHAT, "max_tokens": True}, 400, "invalid_type"),
    ({"model": MODEL, "messages": CHAT, "temperature": -1}, 400, "invalid_value"),
    ({"model": MODEL, "messages": CHAT, "top_p": 1.5}, 400, "invalid_value"),  # 0 is allowed
    ({"model": MODEL, "messages": CHAT, "max_tokens": 0}, 400, "invalid_value"),
    ({"model": MODEL, "messages": CHAT, "n": 0}, 400, "invalid_value"),
    (
        {"model": MODEL, "messages": CHAT, "top_logprobs": 99, "logprobs": True},
        400,
        "invalid_value",
    ),
    ({"model": MODEL, "messages": CHAT, "stop": ["x"] * 17}, 400, "invalid_value"),
    (
        {"model": MODEL, "messages": CHAT, "logit_bias": {str(i): 1 for i in range(301)}},
        400,
        "invalid_value",
    ),
    ({"model": MODEL, "messages": CHAT, "logit_bias": {"99999": 1}}, 400, "invalid_token_id"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_value"),
    ({"model": MODEL, "messages": CHAT, "max_tokens": 10**6}, 400, "context_length_exceeded"),
    ({"model": "nope", "messages": CHAT}, 404, "model_not_found"),
]
BAD_COMPLETIONS = [
    ({"model": MODEL, "prompt": [1, 2, 99999]}, 400, "invalid_token_id"),
    ({"model": MODEL, "prompt": [[1], [-1]]}, 400, "invalid_value"),
    ({"model": MODEL, "prompt": []}, 400, "invalid_value"),
    ({"model": MODEL, "prompt": "x " * 300}, 400, "context_length_exceeded"),
    ({"model": MODEL, "prompt": "x", "temperature": float("nan")}, 400, "invalid_json"),
]


def _post(url, body, headers=AUTH):
    data = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    return httpx.post(url, content=data, headers={**headers, "Content-Type": "application/json"})


@pytest.mark.parametrize(
    ("route", "cases"), [("chat/completions", BAD), ("completions", BAD_COMPLETIONS)]
)
def test_bad_input(server, client, route, cases):
    for body, status, code in cases:
        r = _post(f"{server.base_url}/v1/{route}", body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["code"] == code, (body, err)
        assert err["type"] == "invalid_request_error" and err["message"]
    r = _post(f"{server.base_url}/v1/chat/completions", b"x" * (65 * 1024))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(f"{server.base_url}/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    # The client's own exception types line up, and a normal request still works.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=CHAT, **extra(max_tokens=10**6))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(messages=CHAT, **extra(model="nope"))
    assert client.chat.completions.create(messages=CHAT, **extra()).choices[0].message.content


def test_auth_on_every_route(server):
    routes = [
        ("post", "/v1/chat/completions"),
        ("post", "/v1/completions"),
        ("get", "/v1/models"),
        ("post", "/tokenize"),
        ("post", "/detokenize"),
        ("get", "/metrics"),
    ]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, server.base_url + path, headers=headers, json={})
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_draining_flag_gives_503(server, client):
    state: ServerState = server.app.state.tallow
    state.draining = True
    try:
        assert httpx.get(f"{server.base_url}/health").status_code == 503
        r = _post(f"{server.base_url}/v1/completions", {"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    finally:
        state.draining = False
    assert client.completions.create(prompt="x", **extra(max_tokens=2)).choices[0].text is not None


def test_engine_failure_mid_stream(server, client):
    runner = server.engine.runner
    real, calls = runner.forward, []

    def flaky(items):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(items)

    runner.forward = flaky
    try:
        with httpx.stream(
            "POST",
            f"{server.base_url}/v1/completions",
            headers=AUTH,
            json={**greedy(max_tokens=20), "prompt": "a", "stream": True},
        ) as r:
            lines = [ln for ln in r.iter_lines() if ln]
    finally:
        runner.forward = real
    assert lines[-1] == "data: [DONE]" and '"engine_error"' in lines[-2]
    assert client.completions.create(prompt="a", **extra(max_tokens=3)).usage.completion_tokens == 3


# -- concurrency and disconnects -----------------------------------------------------------------


def test_concurrent_streams_match_solo(aclient):
    prompts = [f"Number {i} is" for i in range(16)]

    async def one(p):
        s = await aclient.completions.create(prompt=p, stream=True, **extra(max_tokens=16))
        return "".join([c.choices[0].text async for c in s if c.choices])

    async def main():
        solo = [await one(p) for p in prompts[:4]]
        together = await asyncio.gather(*(one(p) for p in prompts))
        assert together[:4] == solo
        assert all(together)  # every one completed

    asyncio.run(main())


def test_disconnect_frees_kv(server, client):
    body = {**greedy(max_tokens=200), "prompt": "Disconnect me", "stream": True}
    client.completions.create(prompt="Disconnect me", **extra(max_tokens=2))  # warm prefix cache
    idle = metric(server.base_url, "tallow_kv_cache_pages_used", AUTH)
    url = f"{server.base_url}/v1/completions"
    host, port = server.base_url.removeprefix("http://").split(":")
    raw = json.dumps({**body, "stream": False}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    ).encode() + raw
    gate = ForwardGate(server.engine.runner)
    try:
        for i in range(10):
            if i % 2:  # streaming: hang up after the first event, a decode step held
                gate.hold_after(1)
                with httpx.stream("POST", url, headers=AUTH, json=body, timeout=30) as r:
                    # Keep the line iterator referenced: a dropped one is closed whenever the
                    # garbage collector gets to it, and with it the connection.
                    lines = r.iter_lines()
                    assert next(lines).startswith("data: {")
                    gate.wait_held()
            else:  # non-streaming: leave while the prefill is held
                gate.hold_after(0)
                with socket.create_connection((host, int(port)), timeout=10) as sock:
                    sock.sendall(request)
                    gate.wait_held()
            # The server notices the client left and ends the request before the step ends.
            deadline = time.monotonic() + 60
            while metric(server.base_url, "tallow_server_requests_in_flight", AUTH) != 0:
                assert time.monotonic() < deadline, "a request outlived its client"
                time.sleep(0.02)
            gate.open()
    finally:
        gate.remove()
    deadline = time.monotonic() + 60
    while metric(server.base_url, "tallow_kv_cache_pages_used", AUTH) != idle:
        assert time.monotonic() < deadline, "KV pages were not freed after disconnects"
        time.sleep(0.05)
    assert server.engine.stats().num_running == 0 and server.engine.stats().num_waiting == 0
    r = client.completions.create(prompt="after", **extra(max_tokens=4))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_queue_full_gives_429(artifact):
    s = start_server(
        artifact, ServerOptions(max_queued_requests=1), max_num_seqs=1, kv_cache_mem_mb=4
    )
    real, gate = s.engine.runner.forward, threading.Event()

    def gated(items):  # after the first request's prefill, hold the step until released
        if s.engine.stats().generated_tokens > 0:
            gate.wait(30)
        return real(items)

    s.engine.runner.forward = gated
    url = f"{s.base_url}/v1/completions"
    body = {**greedy(max_tokens=20), "prompt": "Long one"}
    try:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as first:
            first_lines = first.iter_lines()  # referenced: a dropped iterator closes the stream
            next(first_lines)  # it is running, holding the only slot
            waiter = threading.Thread(target=lambda: httpx.post(url, json=body, timeout=30))
            waiter.start()
            deadline = time.monotonic() + 60
            while metric(s.base_url, "tallow_server_queued_requests") < 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.02)
            r = httpx.post(url, json={**greedy(), "prompt": "x"})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            assert r.json()["error"]["type"] == "rate_limit_error"
            gate.set()
        waiter.join(30)
        r = httpx.post(url, json={**greedy(max_tokens=2), "prompt": "x"})
        assert r.status_code == 200
    finally:
        gate.set()
        s.stop()


# -- the CLI process: SIGTERM drain ----------------------------------------------------------


def test_sigterm_drains_in_flight(artifact):
    """SIGTERM while a stream is in flight: the stream runs to its full length, new work is
    refused with 503 (the listener stays open while draining), and the process exits 0."""
    server = start_subprocess(
        artifact, "--max-num-seqs", "1", "--kv-cache-mem", "4", "--shutdown-timeout", "20"
    )
    proc, base = server.proc, server.base_url
    # A normal start says where it serves and with what, and warns about nothing (the KV
    # cache's size is INFO, shown with -v).
    started = server.stderr()
    assert "WARNING" not in started and "KV cache" not in started, started
    assert "sampling defaults:" in started and "serving tiny on http://" in started
    try:
        long = {**greedy(max_tokens=200), "prompt": "Long one", "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)  # the request is being generated now
            proc.send_signal(signal.SIGTERM)
            wait_until_draining(base)
            refused = httpx.post(f"{base}/v1/completions", json=long, timeout=10)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "shutting_down"
            text = first + "".join(lines)
        assert text.endswith("data: [DONE]"), text[-200:]
        assert '"finish_reason":"length"' in text  # all 200 tokens, not cut by the shutdown
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
