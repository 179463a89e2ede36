"""The Responses API shape: `response` objects and the semantic event stream.

One `OutputBuilder` per response turns the completion's deltas into output items, in the order
the model wrote them: a reasoning item (the think block), a message item with `output_text`
content, and one `function_call` item per tool call (`tallow.server.chat_output` splits the
text, as for chat). Each step is also a stream event, each with its `sequence_number`. The
non-streaming body is the same builder run over the same deltas with its events dropped, so a
stream's final response is the non-streamed one by construction.

Streams are SSE with `event: <type>` lines, ending with `response.completed` (or
`response.incomplete` when cut by `max_output_tokens`, `response.failed` after an `error`
event); there is no `data: [DONE]`, as in OpenAI's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tallow.runtime.request import TokenLogprob
from tallow.runtime.served_model import ServedModel

from ..chat_output import ChatOutputOptions, ChoiceDelta, ChoiceStream
from ..errors import APIError
from ..jobs import Job
from ..protocol import ErrorInfo
from ..protocol_responses import (
    ContentPartEvent,
    ErrorEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseError,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponseUsage,
)
from .base import FinishedChoice, ResponseFormatter


def _item_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def sse_named_event(event: BaseModel) -> str:
    """`event: <type>` and `data: <json>`, the Responses stream's framing."""
    body = event.model_dump()
    return f"event: {body['type']}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


@dataclass
class _OpenItem:
    kind: str  # "reasoning", "message" or "call"
    id: str
    index: int  # output_index
    text: str = ""  # reasoning or output text; a call's arguments
    call_id: str = ""
    name: str = ""


class OutputBuilder:
    """Output items and stream events for one completion, fed its text as it comes."""

    def __init__(self, options: ChatOutputOptions) -> None:
        self._choice = ChoiceStream(options)
        self.items: list[OutputItem] = []
        self.events: list[BaseModel] = []
        self.reasoning = ""  # all reasoning text, for the usage's estimate
        self._open: _OpenItem | None = None
        self._seq = 0
        self.finish_reason: str | None = None

    # -- events --------------------------------------------------------------------------------

    def event(self, cls: type[BaseModel], type: str, **fields: Any) -> BaseModel:
        ev = cls(type=type, sequence_number=self._seq, **fields)
        self._seq += 1
        self.events.append(ev)
        return ev

    def take_events(self) -> list[BaseModel]:
        out, self.events = self.events, []
        return out

    # -- items ---------------------------------------------------------------------------------

    def _item(self, it: _OpenItem, status: str) -> OutputItem:
        whole = status != "in_progress"  # an item in progress is sent without content
        if it.kind == "reasoning":
            reasoning = [ReasoningText(text=it.text)] if whole else []
            return ReasoningItem(id=it.id, content=reasoning, status=status)
        if it.kind == "message":
            content = [OutputText(text=it.text)] if whole else []
            return OutputMessage(id=it.id, status=status, content=content)
        return FunctionCallOutput(
            id=it.id, status=status, call_id=it.call_id, name=it.name, arguments=it.text
        )

    def _open_item(self, kind: str, **fields: Any) -> _OpenItem:
        self._close("completed")
        prefix = {"reasoning": "rs_", "message": "msg_", "call": "fc_"}[kind]
        it = self._open = _OpenItem(kind, _item_id(prefix), len(self.items), **fields)
        self.items.append(self._item(it, "in_progress"))  # replaced when it closes
        added = self._item(it, "in_progress")
        if kind == "call":
            added.arguments = ""  # type: ignore[union-attr]
        self.event(OutputItemEvent, "response.output_item.added", output_index=it.index, item=added)
        if kind != "call":
            part = ReasoningText(text="") if kind == "reasoning" else OutputText(text="")
            self.event(
                ContentPartEvent,
                "response.content_part.added",
                item_id=it.id,
                output_index=it.index,
                content_index=0,
                part=part,
            )
        return it

    def _close(self, status: str) -> None:
        it, self._open = self._open, None
        if it is None:
            return
        where = {"item_id": it.id, "output_index": it.index}
        if it.kind == "call":
            self.event(
                FunctionCallArgumentsDoneEvent,
                "response.function_call_arguments.done",
                arguments=it.text,
                **where,
            )
        else:
            reasoning = it.kind == "reasoning"
            self.event(
                ReasoningTextDoneEvent if reasoning else OutputTextDoneEvent,
                "response.reasoning_text.done" if reasoning else "response.output_text.done",
                content_index=0,
                text=it.text,
                **where,
            )
            part = ReasoningText(text=it.text) if reasoning else OutputText(text=it.text)
            self.event(
                ContentPartEvent, "response.content_part.done", content_index=0, part=part, **where
            )
        item = self.items[it.index] = self._item(it, status)
        self.event(OutputItemEvent, "response.output_item.done", output_index=it.index, item=item)

    def _text(self, kind: str, text: str) -> None:
        if not text:
            return
        it = self._open if self._open and self._open.kind == kind else self._open_item(kind)
        it.text += text
        where = {"item_id": it.id, "output_index": it.index, "content_index": 0}
        if kind == "reasoning":
            self.reasoning += text
            self.event(
                ReasoningTextDeltaEvent, "response.reasoning_text.delta", delta=text, **where
            )
        else:
            self.event(OutputTextDeltaEvent, "response.output_text.delta", delta=text, **where)

    def _apply(self, piece: ChoiceDelta) -> None:
        self._text("reasoning", piece.reasoning)
        for part in piece.parts:  # content and calls, in the order written
            if isinstance(part, str):
                self._text("message", part)
                continue
            call = part
            if call.id is not None or self._open is None or self._open.kind != "call":
                self._open_item("call", call_id=call.id or "", name=call.name or "")
            it = self._open
            assert it is not None
            if call.arguments:
                it.text += call.arguments
                self.event(
                    FunctionCallArgumentsDeltaEvent,
                    "response.function_call_arguments.delta",
                    item_id=it.id,
                    output_index=it.index,
                    delta=call.arguments,
                )

    # -- input ---------------------------------------------------------------------------------

    def feed(self, text: str, finish_reason: str | None) -> None:
        self._apply(self._choice.feed(text))
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self._apply(self._choice.finish())

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def close(self) -> None:
        """End the open item; a response that said nothing gets an empty message."""
        self._close(self.status)
        said = any(not isinstance(i, ReasoningItem) for i in self.items)
        if not said and (self.status == "completed" or not self.items):
            self._open_item("message")
            self._close(self.status)


class ResponsesFormatter(ResponseFormatter):
    endpoint = "responses"
    id_prefix = "resp_"

    def __init__(
        self,
        model: ServedModel,
        model_name: str,
        output: ChatOutputOptions,
        settings: dict[str, Any],
    ) -> None:
        super().__init__(model, model_name)
        self.output = output
        self.settings = settings  # the request's settings, echoed in every response object

    def body(
        self,
        job: Job,
        status: str,
        builder: OutputBuilder | None = None,
        error: ErrorInfo | None = None,
    ) -> ResponseObject:
        done = status in ("completed", "incomplete")
        return ResponseObject(
            id=job.id,
            created_at=job.created,
            status=status,
            completed_at=int(time.time()) if status == "completed" else None,
            error=ResponseError(message=error.message) if error else None,
            incomplete_details=(
                IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
            ),
            model=self.model_name,
            output=list(builder.items) if builder else [],
            usage=self.usage(job, builder) if done and builder else None,
            **self.settings,
        )

    def usage(self, job: Job, builder: OutputBuilder) -> ResponseUsage:
        u = job.usage_info()
        # Reasoning tokens are estimated by encoding the reasoning text (the engine reports
        # token counts per completion, not per part).
        reasoning = 0
        if builder.reasoning:
            encoded = self.model.encode_text(builder.reasoning, add_special_tokens=False)
            reasoning = min(len(encoded), u.completion_tokens)
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        return ResponseUsage(
            input_tokens=u.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=u.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
            total_tokens=u.total_tokens,
        )

    # -- the base class's per-delta hooks are not how this shape streams ---------------------

    def response(self, job: Job, choices: list[FinishedChoice]) -> ResponseObject:
        builder = OutputBuilder(self.output)
        for c in choices:
            builder.feed(c.text, c.finish_reason or "stop")
        builder.close()
        return self.body(job, builder.status, builder)

    def delta_chunk(
        self,
        job: Job,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None,
        text_offset: int,
        finish_reason: str | None,
    ) -> BaseModel:
        raise NotImplementedError("the Responses stream is built by ResponsesFormatter.stream")

    def usage_chunk(self, job: Job) -> BaseModel:
        raise NotImplementedError("the Responses stream is built by ResponsesFormatter.stream")

    # -- running a job -------------------------------------------------------------------------

    async def collect(self, job: Job) -> ResponseObject:
        builder = OutputBuilder(self.output)
        try:
            async for _, out in job.outputs():
                for d in out.outputs:
                    builder.feed(d.text, d.finish_reason)
                    builder.take_events()
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine failed: a server error, not the client's
            raise APIError(
                500, f"engine error: {e}", type="server_error", code="engine_error"
            ) from e
        builder.close()
        return self.body(job, builder.status, builder)

    async def stream(self, job: Job, include_usage: bool, num_choices: int) -> AsyncIterator[str]:
        builder = OutputBuilder(self.output)
        for kind in ("response.created", "response.in_progress"):
            builder.event(ResponseLifecycleEvent, kind, response=self.body(job, "in_progress"))
        for ev in builder.take_events():
            yield sse_named_event(ev)
        try:
            async for _, out in job.outputs():
                for d in out.outputs:
                    builder.feed(d.text, d.finish_reason)
                    for ev in builder.take_events():
                        yield sse_named_event(ev)
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, then end
            info = ErrorInfo(message=f"engine error: {e}", type="server_error", code="engine_error")
            builder.event(ErrorEvent, "error", code=info.code, message=info.message, param=None)
            builder.event(
                ResponseLifecycleEvent,
                "response.failed",
                response=self.body(job, "failed", builder, info),
            )
            for ev in builder.take_events():
                yield sse_named_event(ev)
            return
        builder.close()
        final = self.body(job, builder.status, builder)
        builder.event(ResponseLifecycleEvent, f"response.{builder.status}", response=final)
        for ev in builder.take_events():
            yield sse_named_event(ev)
