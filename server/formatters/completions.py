"""The legacy completions shape: `text_completion` bodies and stream chunks."""

from __future__ import annotations

from tallow.runtime.request import TokenLogprob

from ..jobs import Job
from ..protocol import CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse
from .base import FinishedChoice, ResponseFormatter


class CompletionFormatter(ResponseFormatter):
    endpoint = "completion"
    id_prefix = "cmpl-"

    def logprobs(self, lps: list[TokenLogprob] | None, offset: int) -> CompletionLogprobs | None:
        """Parallel lists; `offset` is where the first token's text starts in the completion."""
        if lps is None:
            return None
        tokens, offsets = [], []
        for x in lps:
            text = self.model.token_text(x.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[x.logprob for x in lps],
            top_logprobs=[
                {self.model.token_text(t): lp for t, lp in x.top_logprobs or []} for x in lps
            ],
            text_offset=offsets,
        )

    def response(self, job: Job, choices: list[FinishedChoice]) -> CompletionResponse:
        return CompletionResponse(
            id=job.id,
            created=job.created,
            model=self.model_name,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.text,
                    logprobs=self.logprobs(c.logprobs, 0),
                    finish_reason=c.finish_reason,
                )
                for c in choices
            ],
            usage=job.usage_info(),
        )

    def delta_chunk(
        self,
        job: Job,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None,
        text_offset: int,
        finish_reason: str | None,
    ) -> CompletionChunk:
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=self.logprobs(logprobs, text_offset),
            finish_reason=finish_reason,
        )
        return CompletionChunk(
            id=job.id, created=job.created, model=self.model_name, choices=[choice]
        )

    def usage_chunk(self, job: Job) -> CompletionChunk:
        return CompletionChunk(
            id=job.id,
            created=job.created,
            model=self.model_name,
            choices=[],
            usage=job.usage_info(),
        )
