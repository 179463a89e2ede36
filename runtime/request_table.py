"""The engine's live requests: the inbox callers queue work into, and the step thread's table.

Threading model. All scheduler/runner state is touched by exactly one thread at a time: the
step. Callers never touch it; `Engine.submit`/`abort` post actions to the lock-protected
`Inbox`, which the next step drains and applies on the step thread. The `RequestTable` is that
thread's view of what is live: each request's state and sink, and the stream of each of its
sequences. Finishing, aborting or failing a request always goes through it, so its id is
released (for reuse) in one place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tallow.runtime.completion_stream import CompletionStream
from tallow.runtime.constraint import GrammarMatcher
from tallow.runtime.request import (
    CompletionDelta,
    EmbeddingOutput,
    Request,
    RequestOutput,
    SequenceState,
    TokenLogprob,
    Usage,
)
from tallow.runtime.scheduler import Scheduler

log = logging.getLogger(__name__)

Sink = Callable[["RequestOutput | EmbeddingOutput | BaseException"], None]


@dataclass
class RequestState:
    """One live request on the step thread: where its outputs go and what it has produced."""

    request: Request
    sink: Sink
    seqs: dict[int, CompletionStream] = field(default_factory=dict)  # by completion index
    completion_tokens: int = 0
    cached_tokens: int | None = None  # fixed at the first sample
    num_finished: int = 0
    # Set when the prompt's scores are complete (`prompt_logprobs.py`); sent with the next
    # output, once.
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Inbox:
    """Actions queued by any thread for the step thread, plus the ids of live requests (so a
    duplicate id is rejected at once, before anything is queued). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._actions: list[Callable[[], None]] = []
        self._live_ids: set[str] = set()  # rejects duplicate ids

    def add_request(self, rid: str, action: Callable[[], None]) -> None:
        """Queue the action that adds request `rid`; raises if the id is live already."""
        with self._lock:
            if rid in self._live_ids:
                raise ValueError(f"request id {rid!r} is already in use")
            self._live_ids.add(rid)
            self._actions.append(action)

    def post(self, action: Callable[[], None]) -> None:
        with self._lock:
            self._actions.append(action)

    def take(self) -> list[Callable[[], None]]:
        """Everything queued so far, in order; the inbox is empty afterwards."""
        with self._lock:
            actions, self._actions = self._actions, []
        return actions

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._actions)

    def live_ids(self) -> list[str]:
        with self._lock:
            return list(self._live_ids)

    def release(self, rid: str) -> None:
        """The request is over: its id may be used again."""
        with self._lock:
            self._live_ids.discard(rid)


class RequestTable:
    """The step thread's live requests and sequence streams (step-thread only)."""

    def __init__(
        self, scheduler: Scheduler, inbox: Inbox, tokenizer: Any | None, byte_pieces: Any
    ) -> None:
        self.scheduler = scheduler
        self.inbox = inbox
        self.tokenizer = tokenizer
        self.byte_pieces = byte_pieces  # byte-level tokenizers: one table for every stream
        self.requests: dict[str, RequestState] = {}
        self.by_seq: dict[int, CompletionStream] = {}  # seq_id -> its stream

    def track(
        self, state: RequestState, seq: SequenceState, matcher: GrammarMatcher | None = None
    ) -> CompletionStream:
        st = CompletionStream.open(seq, self.tokenizer, self.byte_pieces, matcher)
        state.seqs[seq.index] = st
        self.by_seq[seq.seq_id] = st
        return st

    def retire(self, st: CompletionStream, delta: CompletionDelta) -> CompletionDelta:
        """Bookkeeping after a sequence's step; frees it if `delta` finishes it."""
        state = self.requests[st.seq.request.request_id]
        if state.cached_tokens is None:
            state.cached_tokens = st.seq.num_cached_tokens
        if delta.finish_reason is not None:
            self.scheduler.finish(st.seq, delta.finish_reason)
            self.by_seq.pop(st.seq.seq_id, None)
            state.num_finished += 1
        return delta

    def emit(self, state: RequestState, deltas: list[CompletionDelta]) -> None:
        req = state.request
        finished = state.num_finished >= req.params.n
        usage = Usage(len(req.prompt_token_ids), state.completion_tokens, state.cached_tokens or 0)
        if finished:
            self.requests.pop(req.request_id, None)
            self.inbox.release(req.request_id)
        scores, state.prompt_logprobs = state.prompt_logprobs, None
        state.sink(RequestOutput(req.request_id, deltas, finished, usage, scores))

    def abort(self, rid: str) -> list[SequenceState]:
        """Stop a request; its final output carries finish_reason "abort". Returns the
        sequences it had in the scheduler (none if it is not live: aborting is idempotent)."""
        state = self.requests.get(rid)
        if state is None:
            return []  # already finished (or never existed)
        aborted = self.scheduler.abort_request(rid)
        deltas = [CompletionDelta(index=seq.index, finish_reason="abort") for seq in aborted]
        for seq in aborted:
            self.by_seq.pop(seq.seq_id, None)
        # Completions not forked yet (n > 1 aborted before its prefill ended) abort too.
        n = state.request.params.n
        deltas += [
            CompletionDelta(index=i, finish_reason="abort") for i in range(n) if i not in state.seqs
        ]
        state.num_finished = n
        self.emit(state, deltas)
        return aborted

    def finish_embedding(self, seq: SequenceState, output: EmbeddingOutput) -> None:
        """An embedding request's vector is ready (its sequence is already finished)."""
        state = self.requests.pop(seq.request.request_id)
        self.inbox.release(seq.request.request_id)
        state.sink(output)

    def fail(self, rid: str, error: BaseException, log_it: bool = True) -> None:
        """Something went wrong for this request alone: it gets the error, its KV is freed."""
        if log_it:
            name = type(error).__name__
            log.error("request %s failed: %s: %s", rid, name, error, exc_info=error)
        state = self.requests.pop(rid, None)
        if state is None:
            return
        for seq in self.scheduler.abort_request(rid):
            self.by_seq.pop(seq.seq_id, None)
        for st in state.seqs.values():
            self.by_seq.pop(st.seq.seq_id, None)
        self.inbox.release(rid)
        state.sink(error)

    def fail_all(self, error: BaseException) -> None:
        """Every live request gets `error` and its KV is freed."""
        self.scheduler.abort_all()
        for rid, state in list(self.requests.items()):
            self.inbox.release(rid)
            state.sink(error)
        self.requests.clear()
        self.by_seq.clear()
