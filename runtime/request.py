"""Requests and the sequences the scheduler moves between queues.

A `Request` is what a client asked for; it owns `n` `SequenceState`s (one per completion). A
sequence's `token_ids` is prompt + generated so far and `num_computed_tokens` counts how many
of those already have KV in the cache. Everything the scheduler does is phrased in those two
numbers: the tokens to feed next are `token_ids[num_computed_tokens:]` (the whole prompt at
first, one sampled token when decoding, everything again after a recompute preemption).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from tallow.runtime.sampling_params import SamplingParams

# "grammar_error": a constrained sequence's grammar could not be continued (see constraint.py).
FinishReason = Literal["stop", "length", "abort", "grammar_error"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV
    RUNNING = "running"  # holds KV; prefilling in chunks or decoding
    PREEMPTED = "preempted"  # KV freed under memory pressure; back in the waiting queue
    FINISHED = "finished"


class ContextLengthExceededError(ValueError):
    """The request can never be served: too long for the context window or the whole cache.

    The server maps this to HTTP 400 with code `context_length_exceeded`.
    """

    code = "context_length_exceeded"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int  # FCFS order; also decides who is "newest" when preempting
    # An embedding request: its prompt prefills (its hidden states pooled by the engine),
    # then it finishes at once, generating nothing. It neither matches nor feeds the prefix
    # cache: pooling needs every prompt token's hidden state.
    embed: bool = False
    # Requests sharing a group (one API request's prompts) take one turn together when the
    # prefill budget is shared (`tallow.runtime.fairness`); None: the request is its own.
    group: str | None = None

    @property
    def fair_key(self) -> str:
        return self.group if self.group is not None else self.request_id

    @property
    def scores_prompt(self) -> bool:
        """It asks for prompt logprobs: every prompt position's logits are needed, so its
        prefill neither skips tokens through the prefix cache nor keeps only the last row."""
        return self.params.prompt_logprobs is not None


@dataclass
class SequenceState:
    """One completion's tokens and where it stands (named so it does not shadow
    `typing.Sequence`)."""

    seq_id: int  # the id under which the runner's KV cache knows this sequence
    request: Request
    index: int  # which of the request's n completions
    token_ids: list[int]  # prompt + generated
    prompt_len: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    # Children still to fork once the prompt is prefilled (n > 1 on the first sequence only).
    pending_forks: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (last admission)
    num_preemptions: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token to feed: a (re)prefill rather than a decode."""
        return self.num_pending_tokens > 1

    @property
    def order(self) -> tuple[int, int]:
        """Sort key for FCFS; the largest key is the newest."""
        return (self.request.arrival_index, self.index)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class ScheduledItem:
    seq: SequenceState
    token_ids: list[int]  # the tokens fed this step
    sample: bool  # the chunk ends at the last known token, so its logits give the next one
    # Speculative decoding: tokens proposed after the sequence's last one, fed after it
    # (`token_ids` ends with them); every fed token's logits come back, to verify them.
    proposals: list[int] = field(default_factory=list)

    @property
    def num_logits(self) -> int:
        """Rows of logits the forward returns for this item."""
        return 1 + len(self.proposals)


@dataclass
class SchedulerOutput:
    """One step's decision, what crosses from the scheduler to the runner and the engine: the
    runner runs `forward_items`, the engine samples the rows of items with `sample`."""

    items: list[ScheduledItem] = field(default_factory=list)
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    preempted: list[SequenceState] = field(default_factory=list)
    new_pages: int = 0  # pages the runner will allocate while running this batch

    @property
    def forward_items(self) -> list[tuple[int, list[int]]]:
        return [(it.seq.seq_id, it.token_ids) for it in self.items]

    @property
    def num_logits(self) -> list[int] | None:
        """Logit rows per item for `forward` (None: one each, no item speculates)."""
        if not any(it.proposals for it in self.items):
            return None
        return [it.num_logits for it in self.items]

    @property
    def empty(self) -> bool:
        return not self.items


# -- what the engine streams back (consumed by the server and the CLI) -----------------------


# The lowest logprob reported. A token can have probability 0 in float32 (log: -inf), and
# JSON has no infinity: the response could not be written (a 500 the fuzz campaign found,
# after a repetition penalty of 5e-324). vLLM reports such tokens as -9999.0 too.
MIN_LOGPROB = -9999.0


def _reportable(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN and -inf alike


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None

    def __post_init__(self) -> None:
        self.logprob = _reportable(self.logprob)
        if self.top_logprobs is not None:
            self.top_logprobs = [(t, _reportable(lp)) for t, lp in self.top_logprobs]


@dataclass
class CompletionDelta:
    """What one of a request's n completions produced since the previous output."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    # The stop token (EOS or a stop_token_ids entry) that ended the completion, with its
    # logprob, when logprobs were asked for: not part of `token_ids` or `text`, but a
    # completions client that scores prompts counts on every sampled token being reported.
    stop_logprob: TokenLogprob | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionDelta]  # only the completions that changed this step
    finished: bool  # every completion has a finish_reason
    usage: Usage
    # With SamplingParams.prompt_logprobs, on the request's first output: one entry per
    # prompt token (None for the first, which nothing predicts).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EmbeddingOutput:
    """An embedding request's one output: its pooled, L2-normalised hidden state."""

    request_id: str
    embedding: np.ndarray  # float32 [hidden_size]
    prompt_tokens: int


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters (for /metrics and logs)."""

    num_waiting: int
    num_running: int
    num_preemptions: int
    kv_pages_used: int
    kv_pages_total: int
    prefix_cache_hit_tokens: int
    prompt_tokens: int
    generated_tokens: int
    num_steps: int
    last_step_latency_s: float
    avg_step_latency_s: float
    # speculative decoding: tokens proposed and accepted by verification, in all
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
