"""Embedding requests inside the engine: validation, host-side pooling, their errors.

An embedding request is a prompt that goes through the scheduler and KV manager like any
prefill, sharing each step's token budget with generation. Its chunks run through
`runner.forward_hidden` in the same step as the generation items' `forward`; the engine pools
the rows on the host across chunks (a running sum and count for mean pooling, the final row
for last-token pooling, restarted when a preempted sequence prefills again from its first
token), and once the last chunk ran the request finishes: its L2-normalised vector goes to its
sink and its pages are freed (never kept as a prefix-cache entry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tallow.runtime.model_runner_protocol import ModelRunner
from tallow.runtime.request import (
    ContextLengthExceededError,
    EmbeddingOutput,
    Request,
    ScheduledItem,
    SequenceState,
)
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.scheduler import Scheduler


class EmbeddingsNotSupportedError(ValueError):
    """The model has no hidden-state function (an artifact compiled before embeddings)."""


class GenerationNotSupportedError(ValueError):
    """The model is embedding-only (`tallow compile --task embed`)."""


class EmbeddingAbortedError(RuntimeError):
    """An embedding request was aborted before its vector was ready."""


@dataclass
class EmbeddingPool:
    """Host-side pooling of one embedding request's hidden states, chunk by chunk."""

    pooling: str  # "mean" or "last"
    total: np.ndarray | None = None  # float64 sum of the rows so far (mean)
    count: int = 0
    last: np.ndarray | None = None

    def add(self, rows: np.ndarray, restart: bool) -> None:
        if restart:  # the prompt prefills from its first token (again, after a preemption)
            self.total, self.count = None, 0
        part = rows.sum(axis=0, dtype=np.float64)
        self.total = part if self.total is None else self.total + part
        self.count += len(rows)
        self.last = rows[-1]

    def vector(self) -> np.ndarray:
        assert self.total is not None and self.last is not None
        v = self.total / self.count if self.pooling == "mean" else self.last.astype(np.float64)
        norm = float(np.linalg.norm(v))
        return (v / norm if norm > 0 else v).astype(np.float32)


class EmbeddingRequests:
    """The embedding side of the engine: checks prompts, adds them to the scheduler, runs
    their chunks through the hidden-state function and pools them (step-thread only, except
    `check_prompt`)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.pools: dict[int, EmbeddingPool] = {}  # embedding seq_id -> its pooling

    @property
    def supported(self) -> bool:
        return getattr(self.runner, "embedding_pooling", None) is not None

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise what submitting this prompt would (nothing is queued)."""
        if not self.supported:
            raise EmbeddingsNotSupportedError(
                "this artifact has no hidden-state function (compiled before embeddings were "
                "supported); recompile it with this tallow to serve embeddings"
            )
        if any(not 0 <= int(t) < self.runner.vocab_size for t in prompt_token_ids):
            raise ValueError("prompt token id outside the vocabulary")
        n, window = len(prompt_token_ids), self.scheduler.context_window
        if n > window:
            raise ContextLengthExceededError(
                f"this model's context window is {window} tokens; the input has {n}"
            )
        self.scheduler.check_request(n, 0, 1)

    def add(self, rid: str, prompt: list[int], group: str | None = None) -> Request:
        """Schedule the prompt's prefill and start its pooling."""
        params = SamplingParams(max_tokens=1)  # unused: an embedding samples nothing
        arrival = self.scheduler.next_arrival_index()
        req = Request(rid, prompt, params, arrival, embed=True, group=group)
        seq = self.scheduler.add_request(req)
        pooling = self.runner.embedding_pooling
        assert pooling is not None
        self.pools[seq.seq_id] = EmbeddingPool(pooling)
        return req

    def run(
        self,
        items: list[ScheduledItem],
        on_done: Callable[[SequenceState, EmbeddingOutput], None],
    ) -> None:
        """Run the step's embedding chunks and pool each one's rows; a request whose prompt
        is done has its sequence finished (pages freed) and goes to `on_done`."""
        hidden = self.runner.forward_hidden([(it.seq.seq_id, it.token_ids) for it in items])
        for item, rows in zip(items, hidden, strict=True):
            seq = item.seq
            pool = self.pools[seq.seq_id]
            pool.add(np.asarray(rows), restart=seq.num_computed_tokens == len(item.token_ids))
            if not item.sample:
                continue  # more of the prompt to come
            self.scheduler.finish(seq, "stop")
            del self.pools[seq.seq_id]
            rid = seq.request.request_id
            on_done(seq, EmbeddingOutput(rid, pool.vector(), seq.prompt_len))

    def forget(self, seq_id: int) -> None:
        """The sequence was aborted: drop its pooling."""
        self.pools.pop(seq_id, None)

    def clear(self) -> None:
        self.pools.clear()
