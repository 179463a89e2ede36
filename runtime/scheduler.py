"""Continuous batching: which tokens of which sequences go into the next forward.

Each `schedule()` builds one mixed batch, in priority order:

1. one decode token for every running sequence that is decoding. These go first so a long
   prompt can never starve generation already under way;
2. prefill: the rest of the budget is shared round-robin across *requests*
   (`tallow.runtime.fairness`; one API request's prompts and n completions are one request).
   Each request with prefill work gets an equal share (then the leftover, in turn order),
   spent on the next chunks of its running prefills and then on admitting its waiting
   sequences, head-of-line blocking only within the request;

all within `max_num_batched_tokens`, `prefill_chunk_size` per sequence and `max_num_seqs`. A
short request behind a huge one is so prefilled in a step or two, and the huge one still
gets its share every step. A waiting head that cannot be admitted (no pages or slots) may be
overtaken by other requests for at most `max_overtake_steps` steps; then admission turns
strict FCFS until it gets in, so a stream of small requests cannot starve it.

The scheduler decides; the `KVCacheManager` accounts (page arithmetic, the prefix cache, every
call into the runner's KV lifecycle) and the engine runs the returned `SchedulerOutput`. A
waiting sequence is admitted only when its whole prompt, the unfinished prefills already
admitted and a small reserve fit in the free pages, so prefills never run dry mid-way. Decodes
grow without a reservation; when they would run the cache dry the scheduler first has the KV
manager evict idle prefix-cache entries, then preempts the newest running sequences by
recompute: their KV is freed and they go back to the head of the waiting queue with prompt +
generated tokens to prefill again (outputs equal up to float rounding: prefill and decode
round differently; bitwise in deterministic mode).

Deterministic mode (`SchedulerConfig.deterministic`) keeps each token's numbers independent
of the batch: whole prompt chunks on a fixed grid, generated tokens recomputed one at a time,
no prefix cache (`_fixed_chunk`; docs/cpu-kernels.md#deterministic-mode).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tallow.runtime.fairness import RoundRobin
from tallow.runtime.kv_manager import KVCacheManager
from tallow.runtime.model_runner_protocol import ModelRunner
from tallow.runtime.request import (
    ContextLengthExceededError,
    FinishReason,
    Request,
    ScheduledItem,
    SchedulerOutput,
    SequenceState,
    SequenceStatus,
)
from tallow.runtime.sampling_params import SamplingParamsError
from tallow.runtime.speculative import SpeculationPolicy


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    # Free pages admission leaves untouched, so freshly admitted prompts do not force an
    # immediate preemption as soon as the running sequences each need a new page.
    reserve_pages: int = 1
    enable_prefix_cache: bool = True
    prefix_cache_max_tokens: int = 8192
    # Steps a blocked waiting head may be overtaken by other requests before admission
    # turns strict FCFS until it is admitted.
    max_overtake_steps: int = 32
    # Batch-invariant outputs (`--deterministic`): every token computed the same way whatever
    # else runs (see `_schedule_chunk`); turns the prefix cache off.
    deterministic: bool = False


@dataclass(frozen=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_preemptions: int  # total since start
    kv_pages_used: int
    kv_pages_total: int
    prefix_cache_hit_tokens: int  # total prompt tokens served from the prefix cache
    prefix_cache_tokens: int  # tokens currently held by cache entries


class Scheduler:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        # The runner's limits are read once; its KV lifecycle is reached only through `kv`.
        self.context_window = runner.context_window
        self.max_num_seqs = min(self.config.max_num_seqs, runner.max_batch_size)
        # TVM's cache sizes its per-forward buffers by prefill_chunk_size: a forward carrying
        # more tokens than that would fail.
        self.max_num_batched_tokens = min(
            self.config.max_num_batched_tokens, runner.prefill_chunk_size
        )
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise running decodes alone could exceed the budget and be dropped.
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")
        if self.config.prefill_chunk_size < 1:
            raise ValueError("prefill_chunk_size must be positive")
        # Deterministic prefill chunks end at multiples of this (see `_schedule_chunk`).
        self.chunk_grid = min(self.config.prefill_chunk_size, self.max_num_batched_tokens)
        self.kv = KVCacheManager(
            runner,
            # a match would start a prefill at the match's length, not on the chunk grid
            enable_prefix_cache=self.config.enable_prefix_cache and not self.config.deterministic,
            prefix_cache_max_tokens=self.config.prefix_cache_max_tokens,
        )
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # kept sorted by SequenceState.order (oldest first)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self._turns = RoundRobin()
        self._overtaken = 0  # steps the current waiting head was blocked and overtaken
        self._blocked_head: SequenceState | None = None
        # Speculative decoding's policy (None: off).
        self.speculation: SpeculationPolicy | None = None
        # How many of some proposals a constrained sequence's grammar allows (the engine's).
        self.grammar_prefix: Callable[[SequenceState, list[int]], int] | None = None

    # -- requests ----------------------------------------------------------------------------

    def check_request(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """Reject at once what can never be served, instead of letting it wait forever."""
        if prompt_len < 1:
            raise ValueError("the prompt must contain at least one token")
        total = prompt_len + max_tokens
        if total > self.context_window:
            raise ContextLengthExceededError(
                f"this model's context window is {self.context_window} tokens; the request "
                f"asks for {total} ({prompt_len} in the prompt + {max_tokens} max_tokens)"
            )
        # A sequence resumed after preemption must fit alone (plus the admission reserve),
        # and the n > 1 fork needs the prompt plus one copied partial page per extra child.
        usable = self.kv.num_pages - self.config.reserve_pages
        need = self.kv.request_pages(prompt_len, max_tokens, n)
        if need > usable:
            raise ContextLengthExceededError(
                f"the request needs {need} KV pages of {self.kv.page_size} tokens but the cache "
                f"has only {usable} usable; shorten the prompt or max_tokens"
            )
        if n > self.max_num_seqs:
            raise SamplingParamsError(f"n: at most {self.max_num_seqs} on this engine (got {n})")

    def add_request(self, request: Request) -> SequenceState:
        """Queue a request's first sequence; its n-1 siblings fork off after the prefill."""
        p = request.params
        max_tokens, n = (0, 1) if request.embed else (p.max_tokens, p.n)
        self.check_request(len(request.prompt_token_ids), max_tokens, n)
        seq = SequenceState(
            seq_id=next(self._seq_ids),
            request=request,
            index=0,
            token_ids=list(request.prompt_token_ids),
            prompt_len=len(request.prompt_token_ids),
            pending_forks=n - 1,
        )
        self.waiting.append(seq)
        return seq

    def next_arrival_index(self) -> int:
        return next(self._arrivals)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling --------------------------------------------------------------------------

    def _outstanding_prefill_pages(self) -> int:
        """Pages the admitted but unfinished prefills (and their forks) will still take."""
        return sum(
            self.kv.remaining_prefill_pages(s)
            for s in self.running
            if s.num_pending_tokens > 1 or s.pending_forks
        )

    def _preempt(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Victims are taken newest first, so appendleft leaves the oldest at the head.
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        while True:
            out = self._schedule_once()
            if out.items or not (self.running or self.waiting):
                return out
            if self.running:
                # Running sequences exist but none could get pages (e.g. two half-done
                # prefills squeezed by decode growth): free the newest and try again.
                self._preempt(self.running[-1])
            elif not out.preempted:
                # Nothing runs and the head cannot be admitted even into an empty cache:
                # check_request makes this impossible, so it is a bug, not a load condition.
                raise RuntimeError("scheduler stalled: waiting request cannot be admitted")
            # else: the last running sequence was just preempted; admit on a fresh pass.

    def _schedule_once(self) -> SchedulerOutput:
        for seq in self.running:  # proposals of a step that failed before verifying
            self.kv.settle_proposals(seq, 0)
        out = SchedulerOutput()
        kv = self.kv
        kv.begin_batch()
        budget = self.max_num_batched_tokens

        # 1. Decodes, oldest first; make room by eviction, then by preempting the newest.
        while True:
            decodes = [s for s in self.running if s.num_pending_tokens == 1]
            need = sum(kv.append_pages(s, 1) + kv.fork_copy_pages(s) for s in decodes)
            if need <= kv.num_free_pages() or not self.running:
                break
            if not kv.evict_one():
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
        proposals = self._proposals(decodes, budget - len(decodes))
        for s in decodes:
            extra = proposals.get(s.seq_id, [])
            kv.plan_append(s, 1 + len(extra), with_forks=True)
            item = ScheduledItem(s, [s.token_ids[-1], *extra], sample=True, proposals=extra)
            out.items.append(item)
            s.num_computed_tokens += 1  # the proposals count once verified (`commit_...`)
            self.kv.hold_proposals(s, len(extra))
            # deterministic: the decodes run as a forward of their own (runner.forward)
            budget -= 0 if self.config.deterministic else 1 + len(extra)
            out.num_decode_tokens += 1 + len(extra)
        scheduled = {s.seq_id for s in decodes}

        # 2. Prefill chunks and admissions, shared round-robin across requests. No admissions
        # in a step that had to preempt: the victim would be readmitted straight away.
        self._schedule_prefills(out, budget, scheduled, admit=not out.preempted)
        out.new_pages = kv.planned_pages
        return out

    def _proposals(self, decodes: list[SequenceState], budget: int) -> dict[int, list[int]]:
        """Speculative tokens per decoding sequence (`speculative.py`), within the token
        budget and the free pages left after every decode's own token."""
        if self.speculation is None or budget <= 0 or not decodes:
            return {}
        kv = self.kv
        free = kv.num_free_pages() - sum(kv.append_pages(s, 1) for s in decodes)
        plan = self.speculation.plan(decodes, budget)
        for s in decodes:
            extra = plan.get(s.seq_id)
            if not extra:
                continue
            room = self.context_window - s.num_computed_tokens - 1
            extra = extra[: max(room, 0)]
            if self.grammar_prefix is not None and s.request.params.grammar is not None:
                extra = extra[: self.grammar_prefix(s, extra)]  # what its grammar allows
            while extra and kv.append_pages(s, 1 + len(extra)) - kv.append_pages(s, 1) > free:
                extra.pop()
            free -= kv.append_pages(s, 1 + len(extra)) - kv.append_pages(s, 1)
            plan[s.seq_id] = extra
        return plan

    def commit_speculation(self, seq: SequenceState, kept: int) -> None:
        """After verification: `kept` of the sequence's proposals stay (`KVCacheManager`)."""
        self.kv.settle_proposals(seq, kept)

    def _schedule_prefills(
        self, out: SchedulerOutput, budget: int, scheduled: set[int], admit: bool
    ) -> None:
        prefilling = (s for s in self.running if s.seq_id not in scheduled and s.is_prefill)
        groups = self._turns.groups(prefilling, self.waiting if admit else ())
        if not groups or budget <= 0:
            return
        self._turns.rotate()
        head = self.waiting[0] if admit and self.waiting else None
        strict = head is self._blocked_head and self._overtaken >= self.config.max_overtake_steps
        blocked: set[str] = set()
        admitted = 0
        share = max(1, budget // len(groups))
        # each group's equal share, then what is left; deterministic: whole chunks in turn
        # order (the group first in turn gets the whole budget, so every chunk runs in time)
        passes = (True,) if self.config.deterministic else (False, True)
        for leftover in passes:
            for g in groups:
                if budget <= 0:
                    break
                allowance = budget if leftover else min(share, budget)
                left = allowance
                while left > 0 and g.prefilling:
                    after = self._schedule_chunk(out, g.prefilling[0], left)
                    if after == left and self.config.deterministic:
                        break  # its whole chunk waits for a larger allowance (or the next step)
                    g.prefilling.pop(0)
                    left = after
                while left > 0 and g.waiting and g.key not in blocked and not g.prefilling:
                    s = g.waiting[0]
                    if (strict and s is not head) or not self._try_admit(s):
                        blocked.add(g.key)
                        break
                    g.waiting.pop(0)
                    self.waiting.remove(s)
                    admitted += 1
                    after = self._schedule_chunk(out, s, left)
                    if after == left and self.config.deterministic:
                        g.prefilling.append(s)  # admitted; its first chunk in the next pass
                    left = after
                budget -= allowance - left
        if head is not None:
            self._note_overtakes(head, blocked, admitted)

    def _try_admit(self, s: SequenceState) -> bool:
        if len(self.running) + 1 + s.pending_forks > self.max_num_seqs:
            return False
        return self._admit(s)

    def _note_overtakes(self, head: SequenceState, blocked: set[str], admitted: int) -> None:
        """Count the steps in which the waiting head was blocked while others got in."""
        if not self.waiting or self.waiting[0] is not head:
            self._blocked_head, self._overtaken = None, 0  # it got in
        elif admitted and head.request.fair_key in blocked:
            if head is not self._blocked_head:
                self._blocked_head, self._overtaken = head, 0
            self._overtaken += 1

    def _schedule_chunk(self, out: SchedulerOutput, s: SequenceState, budget: int) -> int:
        kv = self.kv
        pending = s.num_pending_tokens
        if self.config.deterministic:
            chunk = self._fixed_chunk(s)
            fits = chunk <= min(budget, kv.token_room(s))
            if not fits or (
                chunk == pending
                and kv.append_pages(s, chunk) + kv.fork_copy_pages(s) > kv.num_free_pages()
            ):
                return budget  # the whole chunk next step
        else:
            chunk = min(pending, self.config.prefill_chunk_size, budget, kv.token_room(s))
            if chunk == pending and kv.append_pages(s, chunk) + kv.fork_copy_pages(s) > (
                kv.num_free_pages()
            ):
                chunk -= 1  # the fork copies do not fit yet; finish the prompt next step
        if chunk <= 0:
            return budget
        sample = chunk == pending
        kv.plan_append(s, chunk, with_forks=sample)
        c = s.num_computed_tokens
        out.items.append(ScheduledItem(s, s.token_ids[c : c + chunk], sample=sample))
        s.num_computed_tokens += chunk
        out.num_prefill_tokens += chunk
        return budget - chunk

    def _fixed_chunk(self, s: SequenceState) -> int:
        """The next chunk of `s` in deterministic mode, whatever the budget.

        A prompt token's attention merges the chunk's own rows with the cached ones before
        it, so its numbers depend on where its chunk starts: prompts go in chunks ending on
        multiples of `chunk_grid` (or at the prompt's end). Generated tokens being recomputed
        after a preemption go one at a time, through the decode kernels that first made them
        (`runner.forward` keeps single tokens apart).
        """
        c = s.num_computed_tokens
        if c >= s.prompt_len:
            return 1
        return min(s.prompt_len, (c // self.chunk_grid + 1) * self.chunk_grid) - c

    def _admit(self, s: SequenceState) -> bool:
        """Give `s` KV (from the prefix cache when it can) if its prompt will fit."""
        extra = self._outstanding_prefill_pages() + self.config.reserve_pages
        # With nothing running, only a matched entry's own pages can be in the way (it may
        # hold far more than the shared prefix): then drop the match, not the request.
        # Embeddings and prompt scoring need every prompt token computed: no prefix match.
        whole = s.request.embed or s.request.scores_prompt
        if not self.kv.admit(
            s, extra, retry_without_match=not self.running, use_prefix_cache=not whole
        ):
            return False
        s.status = SequenceStatus.RUNNING
        bisect.insort(self.running, s, key=lambda q: q.order)
        return True

    # -- after the forward -------------------------------------------------------------------

    def fork_children(self, parent: SequenceState) -> list[SequenceState]:
        """Fork the n-1 siblings off a sequence whose prompt was just prefilled; they share
        its KV and were counted in the pages when its last chunk was scheduled."""
        children = []
        for _ in range(parent.pending_forks):
            child = SequenceState(
                seq_id=next(self._seq_ids),
                request=parent.request,
                index=parent.index + 1 + len(children),
                token_ids=list(parent.token_ids),
                prompt_len=parent.prompt_len,
                status=SequenceStatus.RUNNING,
                num_computed_tokens=parent.num_computed_tokens,
                num_cached_tokens=parent.num_cached_tokens,
            )
            self.kv.fork(parent, child)
            bisect.insort(self.running, child, key=lambda q: q.order)
            children.append(child)
        parent.pending_forks = 0
        return children

    def finish(self, seq: SequenceState, reason: FinishReason) -> None:
        """Retire a sequence; its KV becomes a prefix-cache entry unless it was aborted or
        embedded."""
        self.kv.settle_proposals(seq, 0)  # its step failed: the proposals leave the cache
        if self.speculation is not None:
            self.speculation.forget(seq.seq_id)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            keep = reason != "abort" and not seq.request.embed
            self.kv.free(seq, keep_as_prefix=keep)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.pending_forks = 0

    def abort_request(self, request_id: str) -> list[SequenceState]:
        """Finish every live sequence of a request with reason "abort", freeing its KV."""
        seqs = [s for s in (*self.running, *self.waiting) if s.request.request_id == request_id]
        for s in seqs:
            self.finish(s, "abort")
        return seqs

    def abort_all(self) -> None:
        """Drop every sequence after a failed step, freeing what KV the runner lets us free.

        The runner may be in a bad state after the error, so a sequence whose KV cannot be
        freed is still dropped: nothing may be scheduled again without an owner.
        """
        for s in (*self.running, *self.waiting):
            with contextlib.suppress(Exception):
                self.finish(s, "abort")
        self.waiting.clear()
        self.running.clear()

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_preemptions=self.num_preemptions,
            kv_pages_used=self.kv.num_used_pages(),
            kv_pages_total=self.kv.num_pages,
            prefix_cache_hit_tokens=self.kv.prefix_hit_tokens,
            prefix_cache_tokens=self.kv.prefix_cache_tokens,
        )
