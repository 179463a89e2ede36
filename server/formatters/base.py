"""What every API shape shares: running a job to its end (non-streaming) or relaying it as
server-sent events (streaming), and the failure handling of both.

Subclasses say how the pieces look, always as the pydantic models of `tallow.server.protocol`:
the whole response, a stream chunk for one delta, the usage chunk, and the logprobs. The
stream is framed here, byte for byte the same for every shape: `data: <json>` events, then
usage when asked for, then `data: [DONE]`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel

from tallow.runtime.request import CompletionDelta, TokenLogprob
from tallow.runtime.served_model import ServedModel

from ..errors import APIError
from ..jobs import Job
from ..protocol import ErrorInfo, ErrorResponse


@dataclass
class FinishedChoice:
    """One completion's whole text, gathered for a non-streaming response."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    prompt: int = 0  # which of the request's prompts it continues
    prompt_logprobs: PromptLogprobs = None  # when the request asked for them


# The engine's scores of a prompt's tokens (None for the first), or None when not asked for.
PromptLogprobs = list[TokenLogprob | None] | None


@dataclass
class _Gathered:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


def sse_event(payload: dict[str, Any] | str) -> str:
    # json.dumps (ASCII escapes, compact separators) is the wire format clients have seen.
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class ResponseFormatter(ABC):
    endpoint: ClassVar[str]  # the metrics label of the route
    id_prefix: ClassVar[str]  # response ids: prefix + a random hex string

    def __init__(self, model: ServedModel, model_name: str) -> None:
        self.model = model
        self.model_name = model_name

    # -- what a shape defines ------------------------------------------------------------------

    @abstractmethod
    def response(self, job: Job, choices: list[FinishedChoice]) -> BaseModel:
        """The non-streaming body."""

    @abstractmethod
    def delta_chunk(
        self,
        job: Job,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None,
        text_offset: int,
        finish_reason: str | None,
    ) -> BaseModel:
        """A stream chunk for what one completion produced since its previous chunk;
        `text_offset` is where `text` starts in that completion."""

    @abstractmethod
    def usage_chunk(self, job: Job) -> BaseModel:
        """The last chunk before [DONE] when the client asked for usage: no choices."""

    def opening_chunks(self, job: Job, num_choices: int) -> list[BaseModel]:
        """Chunks sent before any output (none unless the shape needs them)."""
        return []

    def choice_opening(
        self, job: Job, index: int, prompt: int, prompt_logprobs: PromptLogprobs
    ) -> tuple[BaseModel | None, int]:
        """A chunk sent before a choice's first output, and the length of the text it
        carries (nothing by default; /v1/completions' echo sends the prompt)."""
        return None, 0

    def delta_logprobs(self, delta: CompletionDelta) -> list[TokenLogprob] | None:
        """The logprobs a delta reports (the completions shape adds the stop token's)."""
        return delta.logprobs

    # -- shared machinery ----------------------------------------------------------------------

    async def collect(self, job: Job) -> BaseModel:
        """Run a job to the end and build the non-streaming response body."""
        gathered: dict[int, _Gathered] = {}
        scores: dict[int, PromptLogprobs] = {}  # by prompt
        want_logprobs = False
        try:
            async for p, out in job.outputs():
                if out.prompt_logprobs is not None:
                    scores[p] = out.prompt_logprobs
                for d in out.outputs:
                    g = gathered.setdefault(p * job.n + d.index, _Gathered())
                    g.text.append(d.text)
                    lps = self.delta_logprobs(d)
                    if lps is not None:
                        want_logprobs = True
                        g.logprobs += lps
                    g.finish_reason = d.finish_reason or g.finish_reason
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine failed: a server error, not the client's
            raise APIError(
                500, f"engine error: {e}", type="server_error", code="engine_error"
            ) from e
        choices = [
            FinishedChoice(
                index=idx,
                text="".join(g.text),
                logprobs=g.logprobs if want_logprobs else None,
                finish_reason=g.finish_reason,
                prompt=idx // job.n,
                prompt_logprobs=scores.get(idx // job.n),
            )
            for idx, g in sorted(gathered.items())
        ]
        return self.response(job, choices)

    async def stream(self, job: Job, include_usage: bool, num_choices: int) -> AsyncIterator[str]:
        """Server-sent events: one chunk per completion delta, then usage, then [DONE]."""

        def event(chunk: BaseModel) -> str:
            # Without stream_options.include_usage the chunks carry no usage key at all.
            return sse_event(chunk.model_dump(exclude=None if include_usage else {"usage"}))

        for chunk in self.opening_chunks(job, num_choices):
            yield event(chunk)
        offsets: dict[int, int] = {}
        scores: dict[int, PromptLogprobs] = {}  # by prompt
        try:
            async for p, out in job.outputs():
                if out.prompt_logprobs is not None:
                    scores[p] = out.prompt_logprobs
                for d in out.outputs:
                    idx = p * job.n + d.index
                    if idx not in offsets:
                        opening, offsets[idx] = self.choice_opening(job, idx, p, scores.get(p))
                        if opening is not None:
                            yield event(opening)
                    offset = offsets[idx]
                    offsets[idx] = offset + len(d.text)
                    lps = self.delta_logprobs(d)
                    chunk = self.delta_chunk(job, idx, d.text, lps, offset, d.finish_reason)
                    yield event(chunk)
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, then end cleanly
            if isinstance(e, APIError):  # e.g. the drain ran out of time: shutting_down
                err = e.info
            else:
                err = ErrorInfo(
                    message=f"engine error: {e}", type="server_error", code="engine_error"
                )
            yield sse_event(ErrorResponse(error=err).model_dump())
            yield sse_event("[DONE]")
            return
        if include_usage:
            yield event(self.usage_chunk(job))
        yield sse_event("[DONE]")
