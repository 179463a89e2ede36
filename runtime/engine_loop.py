"""The engine's asyncio side: the background task that runs steps, and the sinks that carry
outputs from the step thread back to the caller's event loop.

The task runs each step in a worker thread (`asyncio.to_thread`) so the event loop stays free
for HTTP while the model runs; it sleeps on an event while there is no work, and any thread
wakes it (`wake`) after queueing some. Outputs travel back through per-request sinks
(`loop.call_soon_threadsafe` into an asyncio.Queue or future).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import numpy as np

from tallow.runtime.embedding_requests import EmbeddingAbortedError
from tallow.runtime.request import EmbeddingOutput, RequestOutput


class QueueSink:
    """Hands outputs from the step thread to an asyncio.Queue owned by the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def __call__(self, item: RequestOutput | BaseException) -> None:
        # A closed loop means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def stream(self, abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; leaving early (client gone) calls `abort`."""
        done = False
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                abort()


class EmbeddingFutureSink:
    """Resolves an asyncio future (owned by the caller's loop) with an embedding."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[np.ndarray]) -> None:
        self.loop, self.fut = loop, fut

    def _set(self, item: RequestOutput | EmbeddingOutput | BaseException) -> None:
        if self.fut.done():
            return
        if isinstance(item, BaseException):
            self.fut.set_exception(item)
        elif isinstance(item, EmbeddingOutput):
            self.fut.set_result(item.embedding)
        else:
            self.fut.set_exception(EmbeddingAbortedError("the embedding request was aborted"))

    def __call__(self, item: RequestOutput | EmbeddingOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            self.loop.call_soon_threadsafe(self._set, item)


class StepLoop:
    """The background task that runs the engine's steps on an event loop."""

    def __init__(
        self,
        run_step: Callable[[], None],
        has_work: Callable[[], bool],
        on_step_error: Callable[[Exception], None],
    ) -> None:
        self._run_step = run_step
        self._has_work = has_work
        self._on_step_error = on_step_error
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    @property
    def started(self) -> bool:
        """Whether the task exists (started and not stopped)."""
        return self._task is not None

    def start(self) -> None:
        """Start the step loop on the running event loop (idempotent)."""
        if self._task is not None and not self._task.done():
            return
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._task = self._loop.create_task(self._run())

    async def stop(self) -> None:
        """Wait until there is no work left (or the task ended), then stop the task."""
        if self._task is None:
            return
        while self._has_work() and not self._task.done():
            await asyncio.sleep(0.001)
        self._stopping = True
        self.wake()
        await self._task
        self._task = None

    def wake(self) -> None:
        """Tell a sleeping loop there is work (from any thread)."""
        loop, ev = self._loop, self._wakeup
        if loop is None or ev is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            ev.set()
        else:
            loop.call_soon_threadsafe(ev.set)

    async def _run(self) -> None:
        assert self._wakeup is not None
        while not self._stopping:
            if not self._has_work():
                self._wakeup.clear()
                if not self._has_work():
                    await self._wakeup.wait()
                continue
            try:
                await asyncio.to_thread(self._run_step)
            except Exception as e:  # noqa: BLE001 - a failed step must not kill the server
                self._on_step_error(e)
