"""The chat completions shape: `chat.completion` bodies and `chat.completion.chunk` events.

With `ChatOutputOptions` the text of each choice is split into reasoning, content and tool
calls (`tallow.server.chat_output`); a choice that made calls finishes with "tool_calls".
"""

from __future__ import annotations

from typing import Any

from tallow.runtime.request import TokenLogprob
from tallow.runtime.served_model import ServedModel

from ..chat_output import ChatOutputOptions, ChoiceDelta, ChoiceStream, parse_choice
from ..jobs import Job
from ..protocol import UsageInfo
from ..protocol_chat import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaFunctionCall,
    DeltaToolCall,
    ResponseFunctionCall,
    ResponseToolCall,
)
from .base import FinishedChoice, ResponseFormatter


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


def _delta_tool_calls(delta: ChoiceDelta) -> list[DeltaToolCall] | None:
    """The parser's pieces, one item per call (OpenAI sends id, type and name first)."""
    items: dict[int, DeltaToolCall] = {}
    for piece in delta.tool_calls:
        item = items.get(piece.index)
        if item is None:
            item = items[piece.index] = DeltaToolCall(index=piece.index)
        if piece.id is not None:
            item.id, item.type = piece.id, "function"
        if piece.name is not None or piece.arguments:
            fn = item.function or DeltaFunctionCall()
            if piece.name is not None:
                fn.name, fn.arguments = piece.name, fn.arguments or ""
            fn.arguments = (fn.arguments or "") + piece.arguments
            item.function = fn
    return list(items.values()) or None


class ChatFormatter(ResponseFormatter):
    endpoint = "chat"
    id_prefix = "chatcmpl-"

    def __init__(
        self, model: ServedModel, model_name: str, output: ChatOutputOptions | None = None
    ) -> None:
        super().__init__(model, model_name)
        self.output = output or ChatOutputOptions()
        self._streams: dict[int, ChoiceStream] = {}  # per choice, while streaming

    def logprobs(self, lps: list[TokenLogprob] | None) -> ChatChoiceLogprobs | None:
        if lps is None:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.model.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            ChatTokenLogprob(
                **entry(x.token_id, x.logprob),
                top_logprobs=[ChatTopLogprob(**entry(t, lp)) for t, lp in x.top_logprobs or []],
            )
            for x in lps
        ]
        return ChatChoiceLogprobs(content=content)

    def message(self, text: str) -> tuple[ChatResponseMessage, bool]:
        """A choice's message, and whether it made tool calls."""
        if self.output.plain:
            return ChatResponseMessage(content=text), False
        parsed = parse_choice(self.output, text)
        calls = [
            ResponseToolCall(
                id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments)
            )
            for c in parsed.tool_calls
        ]
        message = ChatResponseMessage(
            content=parsed.content, reasoning_content=parsed.reasoning, tool_calls=calls or None
        )
        return message, bool(calls)

    def response(self, job: Job, choices: list[FinishedChoice]) -> ChatCompletionResponse:
        out = []
        for c in choices:
            message, made_calls = self.message(c.text)
            out.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self.logprobs(c.logprobs),
                    finish_reason=_finish_reason(c.finish_reason, made_calls),
                )
            )
        return ChatCompletionResponse(
            id=job.id,
            created=job.created,
            model=self.model_name,
            choices=out,
            usage=job.usage_info(),
        )

    def _chunk(
        self, job: Job, choices: list[ChatChunkChoice], usage: UsageInfo | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=job.id, created=job.created, model=self.model_name, choices=choices, usage=usage
        )

    def opening_chunks(self, job: Job, num_choices: int) -> list[ChatCompletionChunk]:
        # Clients expect the role first, before any content.
        role = ChatDelta(role="assistant", content="")
        return [
            self._chunk(job, [ChatChunkChoice(index=idx, delta=role)]) for idx in range(num_choices)
        ]

    def delta_chunk(
        self,
        job: Job,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None,
        text_offset: int,
        finish_reason: str | None,
    ) -> ChatCompletionChunk:
        if self.output.plain:
            delta = ChatDelta(content=text or None)  # an empty delta is `{}`
        else:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = ChoiceStream(self.output)
            piece = stream.feed(text)
            if finish_reason is not None:
                piece += stream.finish()
                finish_reason = _finish_reason(finish_reason, stream.made_tool_calls)
            delta = ChatDelta(
                content=piece.content or None,
                reasoning_content=piece.reasoning or None,
                tool_calls=_delta_tool_calls(piece),
            )
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=self.logprobs(logprobs),
            finish_reason=finish_reason,
        )
        return self._chunk(job, [choice])

    def usage_chunk(self, job: Job) -> ChatCompletionChunk:
        return self._chunk(job, [], job.usage_info())
