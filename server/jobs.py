"""Running one API request on the engine: submission, the merged output stream, cleanup.

A request with several prompts becomes several engine requests whose output streams are
merged; choice i of prompt p is reported as index p * n + i. Whatever way the consumer stops
(finished, client gone, error), `Job.outputs` aborts every engine request it started, so no
sequence keeps its KV pages after nobody listens. Shaping the outputs as an API's JSON is
the formatters' job (`tallow.server.formatters`); a job knows only its metrics label.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tallow.runtime.request import ContextLengthExceededError, RequestOutput
from tallow.runtime.sampling_params import SamplingParams, SamplingParamsError

from .context import ServerState
from .errors import APIError, bad_request
from .metrics import ServerMetrics
from .protocol import PromptTokensDetails, UsageInfo


class Job:
    """One HTTP request's engine work: submitted at construction, consumed via `outputs`."""

    def __init__(
        self,
        engine: Any,
        state: ServerState,
        metrics: ServerMetrics,
        endpoint: str,
        id_prefix: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        max_queued: int,
    ) -> None:
        self.engine, self.state, self.metrics = engine, state, metrics
        self.endpoint = endpoint  # the metrics label: "chat" or "completion"
        self.id = id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.n = params[0].n
        self.t0 = time.perf_counter()
        self.usage: dict[int, Any] = {}  # prompt index -> last Usage
        self._rids = [f"{self.id}-{i}" for i in range(len(prompts))]
        self._done: set[int] = set()
        self._closed = False
        self._reasons: list[str] = []
        # The limit counts engine sequences (prompts x n), not HTTP requests.
        self._waiting: set[int] = set()  # prompts without an output yet
        check_queue(state, len(prompts) * self.n, max_queued)
        self._streams = []
        try:
            for ids, p, rid in zip(prompts, params, self._rids, strict=True):
                self._streams.append(engine.add_request(ids, p, request_id=rid, group=self.id))
        except BaseException as e:
            self._abort_all()
            raise _engine_rejection(e) from e
        state.queued += len(prompts) * self.n
        self._waiting = set(range(len(prompts)))
        self.metrics.in_flight.inc()
        for ids in prompts:
            metrics.request_prompt_tokens.observe(len(ids))

    def _abort_all(self) -> None:
        for i, rid in enumerate(self._rids[: len(self._streams)]):
            if i not in self._done:
                self.engine.abort(rid)

    def _first_output(self, i: int) -> None:
        if i in self._waiting:
            if len(self._waiting) == len(self._rids):  # the job's first output
                self.metrics.ttft.labels(self.endpoint).observe(time.perf_counter() - self.t0)
            self._waiting.discard(i)
            self.state.queued -= self.n

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
                self._first_output(i)
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
        self.state.queued -= self.n * len(self._waiting)
        self._waiting = set()
        self.metrics.in_flight.dec()
        self.metrics.latency.labels(self.endpoint).observe(time.perf_counter() - self.t0)
        for r in self._reasons or ["abort"]:
            self.metrics.requests.labels(self.endpoint, r).inc()
        gen = sum(u.completion_tokens for u in self.usage.values())
        self.metrics.request_generation_tokens.observe(gen)

    def usage_info(self) -> UsageInfo:
        """Token counts summed over the job's prompts."""
        prompt = sum(u.prompt_tokens for u in self.usage.values())
        completion = sum(u.completion_tokens for u in self.usage.values())
        cached = sum(u.cached_tokens for u in self.usage.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


def check_queue(state: ServerState, num_seqs: int, max_queued: int) -> None:
    """429 when `num_seqs` more waiting sequences would pass the limit. An empty queue takes
    any request, so one larger than the limit is not refused forever."""
    if state.queued and state.queued + num_seqs > max_queued:
        raise APIError(
            429,
            f"the server has {state.queued} sequences waiting (limit {max_queued}); retry later",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )


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
