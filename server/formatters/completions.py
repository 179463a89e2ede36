"""The legacy completions shape: `text_completion` bodies and stream chunks.

With `echo` each choice starts with its prompt; with `echo` and `logprobs` the logprobs cover
the prompt's tokens too (the first has none: nothing predicts it), as OpenAI's and vLLM's
completions do and as lm-evaluation-harness reads them. A completion that ended at a stop
token reports that token's logprob last (its text is not in the choice's text): scoring
clients count on every sampled token being listed.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from tallow.runtime.request import CompletionDelta, TokenLogprob
from tallow.runtime.served_model import ServedModel

from ..jobs import Job
from ..protocol import CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse
from .base import FinishedChoice, PromptLogprobs, ResponseFormatter


@dataclass(frozen=True)
class EchoedPrompt:
    """A prompt as `echo` returns it: its text, and the ids its logprobs are listed for."""

    text: str
    token_ids: list[int]


class CompletionFormatter(ResponseFormatter):
    endpoint = "completion"
    id_prefix = "cmpl-"

    def __init__(
        self,
        model: ServedModel,
        model_name: str,
        echo: list[EchoedPrompt] | None = None,
        with_logprobs: bool = False,
    ) -> None:
        super().__init__(model, model_name)
        self.echo = echo  # per prompt, when the request asked for echo
        self.with_logprobs = with_logprobs

    def delta_logprobs(self, delta: CompletionDelta) -> list[TokenLogprob] | None:
        if delta.logprobs is None or delta.stop_logprob is None:
            return delta.logprobs
        return [*delta.logprobs, delta.stop_logprob]

    def logprobs(
        self,
        lps: list[TokenLogprob] | None,
        offset: int,
        prompt: tuple[list[int], PromptLogprobs] | None = None,
    ) -> CompletionLogprobs | None:
        """Parallel lists; `offset` is where the first token's text starts in the choice's
        text. `prompt` (ids and their scores) lists the prompt's tokens first."""
        if lps is None and prompt is None:
            return None
        result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

        def add(token_id: int, score: TokenLogprob | None) -> None:
            nonlocal offset
            text = self.model.token_text(token_id)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            result.token_logprobs.append(None if score is None else score.logprob)
            tops = None
            if score is not None:
                tops = {self.model.token_text(t): lp for t, lp in score.top_logprobs or []}
            result.top_logprobs.append(tops)

        if prompt is not None:
            ids, scores = prompt
            for i, token_id in enumerate(ids):
                add(token_id, scores[i] if scores is not None and i < len(scores) else None)
        for x in lps or []:
            add(x.token_id, x)
        return result

    def _prompt_part(self, p: int, scores: PromptLogprobs) -> tuple[str, tuple | None]:
        """The echoed text of prompt `p`, and its ids with scores when logprobs are asked."""
        if self.echo is None:
            return "", None
        echoed = self.echo[p]
        return echoed.text, (echoed.token_ids, scores) if self.with_logprobs else None

    def response(self, job: Job, choices: list[FinishedChoice]) -> CompletionResponse:
        out = []
        for c in choices:
            text, prompt = self._prompt_part(c.prompt, c.prompt_logprobs)
            lps = c.logprobs if c.logprobs is not None or not self.with_logprobs else []
            out.append(
                CompletionChoice(
                    index=c.index,
                    text=text + c.text,
                    logprobs=self.logprobs(lps, 0, prompt),
                    finish_reason=c.finish_reason,
                )
            )
        return CompletionResponse(
            id=job.id,
            created=job.created,
            model=self.model_name,
            choices=out,
            usage=job.usage_info(),
        )

    def choice_opening(
        self, job: Job, index: int, prompt: int, prompt_logprobs: PromptLogprobs
    ) -> tuple[BaseModel | None, int]:
        if self.echo is None:
            return None, 0
        text, part = self._prompt_part(prompt, prompt_logprobs)
        choice = CompletionChoice(index=index, text=text, logprobs=self.logprobs(None, 0, part))
        chunk = CompletionChunk(
            id=job.id, created=job.created, model=self.model_name, choices=[choice]
        )
        return chunk, len(text)

    def delta_chunk(
        self,
        job: Job,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None,
        text_offset: int,
        finish_reason: str | None,
    ) -> CompletionChunk:
        if logprobs is None and self.with_logprobs:
            logprobs = []  # e.g. the last chunk of a max_tokens 0 echo: no generated tokens
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
