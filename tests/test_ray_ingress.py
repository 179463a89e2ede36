"""The Serve ingress's own answers (`server/ray_app.py`, `Ingress`), over a stand-in for the
engine deployment's handle: relayed answers pass whole, Serve's full queue is a 429 and a
replica lost before or during its answer an OpenAI-shaped error (in a stream: an error event,
then `[DONE]`), a client leaving cancels the call, and a drain refuses new requests. Fast: no
Ray cluster is started."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve", reason="needs tallow[ray]")

from ray.serve.exceptions import BackPressureError  # noqa: E402
from starlette.requests import Request  # noqa: E402

from tallow.server.asgi_bridge import ResponseStart  # noqa: E402
from tallow.server.ray_app import Ingress  # noqa: E402

SSE = [(b"content-type", b"text/event-stream"), (b"x-tallow-replica", b"r1")]
EVENT = b'data: {"choices": []}\n\n'


class Parts:
    """What `handle.options(stream=True).forward.remote(...)` returns: the replica's parts,
    or `error` raised after them."""

    def __init__(self, parts: list, error: BaseException | None = None) -> None:
        self._parts, self._error, self.cancelled, self.request = list(parts), error, False, None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._parts:
            return self._parts.pop(0)
        if self._error is not None:
            raise self._error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.forward = self

    def options(self, **_):
        return self

    def remote(self, request):
        self.parts.request = request
        return self.parts


def request(path: str = "/v1/completions", body: bytes = b'{"prompt": "Hi"}') -> Request:
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5),
    }
    return Request(scope, receive)


async def answer(ingress: Ingress, req: Request, read: int | None = None):
    response = await ingress(req)
    chunks = []
    if hasattr(response, "body_iterator"):
        iterator = response.body_iterator
        async for chunk in iterator:
            chunks.append(chunk)
            if read is not None and len(chunks) == read:
                await iterator.aclose()  # what Starlette does when the client goes
                break
        return response.status_code, dict(response.raw_headers), b"".join(chunks)
    return response.status_code, dict(response.raw_headers), response.body


def test_an_answer_is_relayed_whole_and_the_prompt_goes_to_the_router():
    parts = Parts([ResponseStart(200, SSE), EVENT, b"data: [DONE]\n\n"])
    ingress = Ingress(Handle(parts), max_body_bytes=1000)
    status, headers, body = asyncio.run(answer(ingress, request()))
    assert status == 200 and headers[b"x-tallow-replica"] == b"r1"
    assert body == EVENT + b"data: [DONE]\n\n"
    assert parts.request.prompt == "Hi" and parts.request.body == b'{"prompt": "Hi"}'
    assert ingress.in_flight == 0 and not parts.cancelled


def test_serves_full_queue_is_429():
    parts = Parts([], BackPressureError(num_queued_requests=5, max_queued_requests=5))
    status, headers, body = asyncio.run(answer(Ingress(Handle(parts), 1000), request()))
    assert status == 429 and headers[b"retry-after"] == b"1"
    assert json.loads(body)["error"]["code"] == "too_many_requests"


def test_a_replica_lost_before_answering_is_503():
    parts = Parts([], RuntimeError("ActorDiedError"))
    ingress = Ingress(Handle(parts), 1000)
    status, _, body = asyncio.run(answer(ingress, request()))
    assert status == 503 and json.loads(body)["error"]["code"] == "replica_unavailable"
    assert ingress.in_flight == 0


def test_a_replica_lost_mid_stream_ends_it_with_an_error_event_and_done():
    parts = Parts([ResponseStart(200, SSE), EVENT], RuntimeError("ActorDiedError"))
    status, _, body = asyncio.run(answer(Ingress(Handle(parts), 1000), request()))
    events = body.decode().strip().split("\n\n")
    assert status == 200 and events[0] == EVENT.decode().strip()
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == "replica_unavailable"
    assert events[2] == "data: [DONE]"


def test_a_client_that_leaves_cancels_the_call_on_its_replica():
    parts = Parts([ResponseStart(200, SSE), EVENT, EVENT, EVENT])
    ingress = Ingress(Handle(parts), 1000)
    asyncio.run(answer(ingress, request(), read=1))
    assert parts.cancelled and ingress.in_flight == 0


def test_a_body_past_the_limit_is_413_before_any_replica():
    parts = Parts([ResponseStart(200, SSE)])
    status, _, body = asyncio.run(answer(Ingress(Handle(parts), 10), request()))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert parts.request is None


def test_a_draining_ingress_refuses_new_requests_and_is_not_ready():
    parts = Parts([ResponseStart(200, SSE)])
    ingress = Ingress(Handle(parts), 1000)
    assert asyncio.run(ingress.drain(timeout=5)) == 0
    status, _, body = asyncio.run(answer(ingress, request()))
    assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
    assert asyncio.run(answer(ingress, request("/health/ready")))[0] == 503
    assert asyncio.run(answer(ingress, request("/health/live")))[0] == 200
    assert parts.request is None
