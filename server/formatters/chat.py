"""The chat completions shape: `chat.completion` bodies and `chat.completion.chunk` events."""

from __future__ import annotations

from typing import Any

from tallow.runtime.request import TokenLogprob

from ..jobs import Job
from ..protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    UsageInfo,
)
from .base import FinishedChoice, ResponseFormatter


class ChatFormatter(ResponseFormatter):
    endpoint = "chat"
    id_prefix = "chatcmpl-"

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

    def response(self, job: Job, choices: list[FinishedChoice]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=job.id,
            created=job.created,
            model=self.model_name,
            choices=[
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=c.text),
                    logprobs=self.logprobs(c.logprobs),
                    finish_reason=c.finish_reason,
                )
                for c in choices
            ],
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
        choice = ChatChunkChoice(
            index=index,
            delta=ChatDelta(content=text or None),  # an empty delta is `{}`
            logprobs=self.logprobs(logprobs),
            finish_reason=finish_reason,
        )
        return self._chunk(job, [choice])

    def usage_chunk(self, job: Job) -> ChatCompletionChunk:
        return self._chunk(job, [], job.usage_info())
