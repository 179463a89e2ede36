"""Running one API request on the engine and shaping its outputs as OpenAI responses.

A request with several prompts becomes several engine requests whose output streams are
merged; choice i of prompt p is reported as index p * n + i. Whatever way the consumer stops
(finished, client gone, error), `Job.outputs` aborts every engine request it started, so no
sequence keeps its KV pages after nobody listens.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from tallow.runtime.request import ContextLengthExceededError, RequestOutput, TokenLogprob
from tallow.runtime.sampling_params import SamplingParams, SamplingParamsError

from .errors import APIError, bad_request
from .metrics import ServerMetrics
from .prompts import ModelInfo

Kind = Literal["chat", "completion"]


@dataclass
class ServerState:
    """Mutable per-app state; the event loop is its only writer."""

    ready: bool = False
    draining: bool = False
    queued: int = 0  # accepted requests that have not produced an output yet


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0  # completions' logprobs report where each token's text starts


class Job:
    """One HTTP request's engine work: submitted at construction, consumed via `outputs`."""

    def __init__(
        self,
        engine: Any,
        state: ServerState,
        metrics: ServerMetrics,
        kind: Kind,
        prompts: list[list[int]],
        params: list[SamplingParams],
        max_queued: int,
    ) -> None:
        self.engine, self.state, self.metrics, self.kind = engine, state, metrics, kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.n = params[0].n
        self.t0 = time.perf_counter()
        self.usage: dict[int, Any] = {}  # prompt index -> last Usage
        self._rids = [f"{self.id}-{i}" for i in range(len(prompts))]
        self._done: set[int] = set()
        self._closed = False
        self._reasons: list[str] = []
        if state.queued >= max_queued:
            raise APIError(
                429,
                f"the server has {state.queued} requests waiting; retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self._streams = []
        try:
            for ids, p, rid in zip(prompts, params, self._rids, strict=True):
                self._streams.append(engine.add_request(ids, p, request_id=rid))
        except BaseException as e:
            self._abort_all()
            raise _engine_rejection(e) from e
        state.queued += 1
        self._waiting = True
        self.metrics.in_flight.inc()
        for ids in prompts:
            metrics.request_prompt_tokens.observe(len(ids))

    def _abort_all(self) -> None:
        for i, rid in enumerate(self._rids[: len(self._streams)]):
            if i not in self._done:
                self.engine.abort(rid)

    def _first_output(self) -> None:
        if self._waiting:
            self._waiting = False
            self.state.queued -= 1
            self.metrics.ttft.labels(self.kind).observe(time.perf_counter() - self.t0)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs until every engine request has finished."""
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
        reasons: list[str] = []
        try:
            while len(self._done) < len(tasks):
                i, item = await queue.get()
                if item is None:
                    self._done.add(i)
                    continue
                if isinstance(item, BaseException):
                    self._done.add(i)
                    raise item
                self._first_output()
                self.usage[i] = item.usage
                reasons += [d.finish_reason for d in item.outputs if d.finish_reason]
                yield i, item
        finally:
            # Cancelling a pump closes its engine stream, which aborts that request.
            for t in tasks:
                t.cancel()
            self._reasons = reasons
            self.close()

    def close(self) -> None:
        """Abort what is still running and record the request (idempotent).

        Called by `outputs` and also by the response, since a client can leave before the
        response body starts, when `outputs` never ran.
        """
        if self._closed:
            return
        self._closed = True
        self._abort_all()
        if self._waiting:
            self._waiting = False
            self.state.queued -= 1
        self.metrics.in_flight.dec()
        self.metrics.latency.labels(self.kind).observe(time.perf_counter() - self.t0)
        for r in self._reasons or ["abort"]:
            self.metrics.requests.labels(self.kind, r).inc()
        gen = sum(u.completion_tokens for u in self.usage.values())
        self.metrics.request_generation_tokens.observe(gen)

    def usage_dict(self) -> dict[str, Any]:
        prompt = sum(u.prompt_tokens for u in self.usage.values())
        completion = sum(u.completion_tokens for u in self.usage.values())
        cached = sum(u.cached_tokens for u in self.usage.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def _engine_rejection(e: BaseException) -> BaseException:
    """Map the engine's synchronous validation errors to 400s."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthExceededError):
        return bad_request(str(e), "max_tokens", ContextLengthExceededError.code)
    if isinstance(e, SamplingParamsError):
        name = str(e).split(":", 1)[0]
        return bad_request(str(e), name if name.isidentifier() else None)
    if isinstance(e, ValueError):
        return bad_request(str(e))
    return e


# -- formatting -----------------------------------------------------------------------------


def _chat_logprobs(lps: list[TokenLogprob], info: ModelInfo) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        t = info.token_text(tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode())}

    return {
        "content": [
            {
                **entry(x.token_id, x.logprob),
                "top_logprobs": [entry(t, lp) for t, lp in x.top_logprobs or []],
            }
            for x in lps
        ]
    }


def _completion_logprobs(lps: list[TokenLogprob], info: ModelInfo, offset: int) -> dict[str, Any]:
    tokens, offsets = [], []
    for x in lps:
        t = info.token_text(x.token_id)
        tokens.append(t)
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [x.logprob for x in lps],
        "top_logprobs": [{info.token_text(t): lp for t, lp in x.top_logprobs or []} for x in lps],
        "text_offset": offsets,
    }


def _format_logprobs(
    kind: Kind, lps: list[TokenLogprob] | None, info: ModelInfo, offset: int
) -> dict[str, Any] | None:
    if lps is None:
        return None
    return _chat_logprobs(lps, info) if kind == "chat" else _completion_logprobs(lps, info, offset)


async def collect(job: Job, info: ModelInfo, model: str) -> dict[str, Any]:
    """Run a job to the end and build the non-streaming response body."""
    choices: dict[int, _Choice] = {}
    want_lp = False
    try:
        async for p, out in job.outputs():
            for d in out.outputs:
                c = choices.setdefault(p * job.n + d.index, _Choice())
                c.text.append(d.text)
                if d.logprobs is not None:
                    want_lp = True
                    c.logprobs += d.logprobs
                c.finish_reason = d.finish_reason or c.finish_reason
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - the engine failed: a server error, not the client's
        raise APIError(500, f"engine error: {e}", type="server_error", code="engine_error") from e
    body: list[dict[str, Any]] = []
    for idx in sorted(choices):
        c = choices[idx]
        text = "".join(c.text)
        lp = _format_logprobs(job.kind, c.logprobs, info, 0) if want_lp else None
        if job.kind == "chat":
            msg = {"role": "assistant", "content": text}
            body.append(
                {"index": idx, "message": msg, "logprobs": lp, "finish_reason": c.finish_reason}
            )
        else:
            body.append(
                {"index": idx, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
            )
    return {
        "id": job.id,
        "object": "chat.completion" if job.kind == "chat" else "text_completion",
        "created": job.created,
        "model": model,
        "choices": body,
        "usage": job.usage_dict(),
    }


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def stream(
    job: Job, info: ModelInfo, model: str, include_usage: bool, num_prompts: int
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per completion delta, then usage, then [DONE]."""
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
        head = {"id": job.id, "object": obj, "created": job.created, "model": model}
        return _sse({**head, "choices": choices, **extra, **more})

    offsets: dict[int, int] = {}
    if job.kind == "chat":
        # Clients expect the role first, before any content.
        for idx in range(num_prompts * job.n):
            delta = {"role": "assistant", "content": ""}
            yield chunk([{"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}])
    try:
        async for p, out in job.outputs():
            for d in out.outputs:
                idx = p * job.n + d.index
                off = offsets.get(idx, 0)
                lp = _format_logprobs(job.kind, d.logprobs, info, off)
                offsets[idx] = off + len(d.text)
                if job.kind == "chat":
                    delta = {"content": d.text} if d.text else {}
                    c = {"index": idx, "delta": delta, "logprobs": lp}
                else:
                    c = {"index": idx, "text": d.text, "logprobs": lp}
                yield chunk([{**c, "finish_reason": d.finish_reason}])
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, then end cleanly
        err = {"message": f"engine error: {e}", "type": "server_error", "param": None}
        yield _sse({"error": {**err, "code": "engine_error"}})
        yield _sse("[DONE]")
        return
    if include_usage:
        yield chunk([], usage=job.usage_dict())
    yield _sse("[DONE]")
