"""One completion's output stream: sampled tokens in, what the client is sent out.

The engine keeps one `CompletionStream` per sequence for the per-stream state that turns a
sampled token into a `CompletionDelta`: the sequence's own random generator (so a seeded
request draws the same tokens whatever shares its batch), the incremental detokenizer, the
stop-string matcher and, for a constrained request, its grammar matcher (which survives
preemption with the stream: the tokens it consumed are the ones re-prefilled). Request-level
bookkeeping (usage, sinks) stays in the engine.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from .constraint import GRAMMAR_ERROR, GrammarMatcher
from .detokenizer import IncrementalDetokenizer
from .request import CompletionDelta, FinishReason, SequenceState, TokenLogprob
from .sampler import make_generator
from .stop_strings import StopStringMatcher


@dataclass
class CompletionStream:
    seq: SequenceState
    generator: np.random.Generator | None
    detok: IncrementalDetokenizer | None
    stop: StopStringMatcher
    matcher: GrammarMatcher | None = None  # set when the request has a grammar

    @classmethod
    def open(
        cls,
        seq: SequenceState,
        tokenizer: Any | None,
        byte_pieces: Any | None,
        matcher: GrammarMatcher | None = None,
    ) -> CompletionStream:
        p = seq.request.params
        if p.seed is None or seq.index == 0:
            gen = make_generator(p.seed)
        else:  # siblings get distinct but reproducible streams
            gen = np.random.default_rng((p.seed % (1 << 64), seq.index))
        detok = (
            IncrementalDetokenizer(tokenizer, seq.request.prompt_token_ids, byte_pieces=byte_pieces)
            if tokenizer is not None
            else None
        )
        stop = StopStringMatcher(p.stop)
        return cls(seq=seq, generator=gen, detok=detok, stop=stop, matcher=matcher)

    def accept(
        self, token: int, lp: TokenLogprob | None, eos_token_ids: Collection[int]
    ) -> CompletionDelta:
        """Append a sampled token and run the stop checks; returns what to stream, with
        `finish_reason` set when this token ends the completion."""
        seq = self.seq
        p = seq.request.params
        seq.token_ids.append(token)
        delta = CompletionDelta(index=seq.index, logprobs=[] if p.logprobs else None)
        reason: FinishReason | None = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
            reason = "stop"  # the stop token itself is not part of the returned completion
            if p.logprobs:
                delta.stop_logprob = lp
        else:
            delta.token_ids.append(token)
            if delta.logprobs is not None and lp is not None:
                delta.logprobs.append(lp)
            text = self.detok.push(token) if self.detok is not None else ""
            delta.text, matched = self.stop.feed(text)
            if matched:
                reason = "stop"
            elif self.matcher is not None:
                if not self.matcher.accept(token):
                    reason = GRAMMAR_ERROR
                elif self.matcher.is_finished:
                    reason = "stop"  # the grammar is complete: only EOS could follow
        if reason is None and seq.num_output_tokens >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(delta, reason)
        return delta

    def finish(self, reason: FinishReason) -> CompletionDelta:
        """End the completion without a new token (a grammar that cannot go on, or is done)."""
        return self._finish(CompletionDelta(index=self.seq.index), reason)

    def _finish(self, delta: CompletionDelta, reason: FinishReason) -> CompletionDelta:
        if not self.stop.stopped:
            tail = self.detok.flush() if self.detok is not None else ""
            delta.text += self.stop.feed(tail)[0] + self.stop.flush()
        delta.finish_reason = reason
        return delta
