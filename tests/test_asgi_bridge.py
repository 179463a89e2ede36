"""`server/asgi_bridge.py`, which runs tallow's app for each request an engine replica gets
under Ray Serve: answers and streams pass through whole, the replica tag is added, and a
consumer that stops reading aborts the sequence. Fast: the fake runner, no Ray."""

from __future__ import annotations

import asyncio
import json

import pytest
from server_helpers import MODEL

from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server.app import ServerOptions, create_app
from tallow.server.asgi_bridge import Forwarded, Lifespan, ResponseStart, call

TAG = [(b"x-tallow-replica", b"r1")]
JSON = [(b"content-type", b"application/json"), (b"host", b"127.0.0.1")]


def make_app(bundle, **options):
    tok = bundle.tokenizer
    runner = FakeModelRunner(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), context_window=1024, num_pages=256
    )
    runner.tokenizer = bundle
    engine = Engine(
        runner,
        tokenizer=tok,
        eos_token_ids=bundle.eos_token_ids,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024),
    )
    return create_app(engine, MODEL, ServerOptions(**options)), engine


async def collect(app, request: Forwarded) -> tuple[ResponseStart, bytes]:
    parts = [part async for part in call(app, request, TAG)]
    start, *body = parts
    assert isinstance(start, ResponseStart)
    return start, b"".join(body)


def completion(max_tokens: int, stream: bool) -> Forwarded:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "stream": stream}
    body["ignore_eos"] = True
    return Forwarded("POST", "/v1/completions", headers=JSON, body=json.dumps(body).encode())


def test_answers_pass_through_with_the_replica_tag(hygiene_bundle):
    app, _ = make_app(hygiene_bundle, api_key="k")

    async def run():
        lifespan = Lifespan(app)
        assert not lifespan.running
        await lifespan.startup()
        assert lifespan.running
        try:
            denied = await collect(app, Forwarded("GET", "/v1/models", headers=JSON))
            key = [*JSON, (b"authorization", b"Bearer k")]
            models = await collect(app, Forwarded("GET", "/v1/models", headers=key))
            streamed = await collect(
                app,
                Forwarded("POST", "/v1/completions", headers=key, body=completion(5, True).body),
            )
        finally:
            await lifespan.shutdown()
        assert not lifespan.running
        return denied, models, streamed

    denied, models, streamed = asyncio.run(run())
    assert denied[0].status == 401
    assert json.loads(denied[1])["error"]["code"] == "invalid_api_key"
    assert models[0].status == 200 and (b"x-tallow-replica", b"r1") in models[0].headers
    assert json.loads(models[1])["data"][0]["id"] == MODEL
    events = [e for e in streamed[1].decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 6  # 5 tokens, then [DONE]


def test_a_consumer_that_stops_reading_aborts_the_sequence(hygiene_bundle):
    app, engine = make_app(hygiene_bundle)

    async def run():
        lifespan = Lifespan(app)
        await lifespan.startup()
        try:
            stream = call(app, completion(900, True), TAG)
            start = await stream.__anext__()
            assert start.status == 200
            await stream.__anext__()  # one event: the sequence runs
            running = engine.stats().num_running
            await stream.aclose()  # what a cancelled Serve call does
            for _ in range(500):
                if engine.stats().num_running == 0:
                    break
                await asyncio.sleep(0.02)
            return running, engine.stats()
        finally:
            await lifespan.shutdown()

    running, after = asyncio.run(run())
    assert running == 1
    assert after.num_running == 0 and after.num_waiting == 0
    assert after.generated_tokens < 900


def test_routing_text():
    pytest.importorskip("ray.serve", reason="needs tallow[ray]")
    from tallow.server.ray_app import routing_text

    chat = {"messages": [{"role": "system", "content": "A"}, {"role": "user", "content": "B"}]}
    assert routing_text(json.dumps(chat).encode()) == "AB"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "C"}]}]}
    assert routing_text(json.dumps(parts).encode()) == "C"
    assert routing_text(b'{"prompt": ["x", "y"]}') == "xy"
    assert routing_text(b'{"input": "z"}') == "z"
    assert routing_text(b"not json") == routing_text(b"[1]") == routing_text(b"{}") == ""
