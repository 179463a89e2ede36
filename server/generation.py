"""Answering a generation request, whatever its API shape: submit the job, then either stream
its events or wait for the whole body while watching for the client leaving."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tallow.runtime.sampling_params import SamplingParams

from .context import ServerContext
from .formatters import ResponseFormatter
from .jobs import Job

T = TypeVar("T")


class SSEResponse(StreamingResponse):
    """Closes the job however the response ends; a never-started generator has no finally."""

    def __init__(self, content: Any, job: Job) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.job.close()


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (whatever it
    started in the engine is aborted by its own cleanup) and `ClientGone` is raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientGone
    return task.result()


async def generate_response(
    request: Request,
    context: ServerContext,
    formatter: ResponseFormatter,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    stream: bool,
    include_usage: bool,
) -> Response:
    job = Job(
        context.engine,
        context.state,
        context.metrics,
        formatter.endpoint,
        formatter.id_prefix,
        prompts,
        params,
        context.options.max_queued_requests,
    )
    if stream:
        num_choices = len(prompts) * job.n
        return SSEResponse(formatter.stream(job, include_usage, num_choices), job)
    try:
        body = await unless_client_leaves(request, formatter.collect(job))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the status is for the log
    finally:
        job.close()  # a collect cancelled before it started never closed the job itself
    # A long answer with logprobs is megabytes of JSON: rendered off the loop.
    return await context.off_loop(lambda: JSONResponse(body.model_dump()))
