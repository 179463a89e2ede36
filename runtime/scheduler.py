"""Continuous batching: which tokens of which sequences go into the next forward.

Each `schedule()` builds one mixed batch, in priority order:

1. one decode token for every running sequence that is decoding. These go first so a long
   prompt can never starve generation already under way;
2. the next chunk of every running sequence still prefilling (FCFS), then
3. newly admitted waiting sequences (FCFS, head-of-line blocking so nobody is overtaken),

all within `max_num_batched_tokens`, `prefill_chunk_size` per sequence and `max_num_seqs`.

Pages are predicted, not discovered: a sequence of L tokens holds ceil(L / page_size) pages,
so appending k tokens costs ceil((L+k)/ps) - ceil(L/ps) new ones (pages shared with a fork
parent are never written again, because forks from the prefix cache are page-aligned and an
n > 1 fork copies the partial page). A waiting sequence is admitted only when its whole prompt,
the unfinished prefills already admitted and a small reserve fit in the free pages, so
prefills never run dry mid-way. Decodes grow without a reservation; when they would run the
cache dry the scheduler first evicts idle prefix-cache entries, then preempts the newest
running sequences by recompute: their KV is freed and they go back to the head of the
waiting queue with prompt + generated tokens to prefill again, which is invisible in outputs.

The scheduler owns the runner's sequence lifecycle (add/fork/remove/popn); the engine only
calls `forward`.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass

from tallow.runtime.model_runner_protocol import ModelRunner, pages_for
from tallow.runtime.prefix_cache import PrefixCache
from tallow.runtime.request import (
    ContextLengthExceededError,
    FinishReason,
    Request,
    ScheduledItem,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
)
from tallow.runtime.sampling_params import SamplingParamsError


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
        self.runner = runner
        self.config = config or SchedulerConfig()
        self.max_num_seqs = min(self.config.max_num_seqs, runner.max_batch_size)
        # Not part of the protocol, but TVM's cache sizes its per-forward buffers by it: a
        # forward carrying more tokens than the cache's prefill_chunk_size would fail.
        self.max_num_batched_tokens = min(
            self.config.max_num_batched_tokens,
            getattr(runner, "prefill_chunk_size", None) or self.config.max_num_batched_tokens,
        )
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise running decodes alone could exceed the budget and be dropped.
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")
        if self.config.prefill_chunk_size < 1:
            raise ValueError("prefill_chunk_size must be positive")
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(runner.page_size, self.config.prefix_cache_max_tokens)
            if self.config.enable_prefix_cache
            else None
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept sorted by Sequence.order (oldest first)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0

    # -- requests ----------------------------------------------------------------------------

    def check_request(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """Reject at once what can never be served, instead of letting it wait forever."""
        r = self.runner
        if prompt_len < 1:
            raise ValueError("the prompt must contain at least one token")
        total = prompt_len + max_tokens
        if total > r.context_window:
            raise ContextLengthExceededError(
                f"this model's context window is {r.context_window} tokens; the request asks "
                f"for {total} ({prompt_len} in the prompt + {max_tokens} max_tokens)"
            )
        # A sequence resumed after preemption must fit alone (plus the admission reserve),
        # and the n > 1 fork needs the prompt plus one copied partial page per extra child.
        usable = r.num_pages - self.config.reserve_pages
        fork_copies = (n - 1) if prompt_len % r.page_size else 0
        need = max(pages_for(total, r.page_size), pages_for(prompt_len, r.page_size) + fork_copies)
        if need > usable:
            raise ContextLengthExceededError(
                f"the request needs {need} KV pages of {r.page_size} tokens but the cache "
                f"has only {usable} usable; shorten the prompt or max_tokens"
            )
        if n > self.max_num_seqs:
            raise SamplingParamsError(f"n: at most {self.max_num_seqs} on this engine (got {n})")

    def add_request(self, request: Request) -> Sequence:
        """Queue a request's first sequence; its n-1 siblings fork off after the prefill."""
        p = request.params
        self.check_request(len(request.prompt_token_ids), p.max_tokens, p.n)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request=request,
            index=0,
            token_ids=list(request.prompt_token_ids),
            prompt_len=len(request.prompt_token_ids),
            pending_forks=p.n - 1,
        )
        self.waiting.append(seq)
        return seq

    def next_arrival_index(self) -> int:
        return next(self._arrivals)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling --------------------------------------------------------------------------

    def _new_pages(self, seq: Sequence, n_tokens: int) -> int:
        ps = self.runner.page_size
        c = seq.num_computed_tokens
        return pages_for(c + n_tokens, ps) - pages_for(c, ps)

    def _fork_pages(self, seq: Sequence) -> int:
        """Pages the n > 1 fork after this sequence's prefill copies (one per partial page)."""
        if seq.pending_forks and seq.prompt_len % self.runner.page_size:
            return seq.pending_forks
        return 0

    def _outstanding_prefill_pages(self) -> int:
        ps = self.runner.page_size
        return sum(
            pages_for(len(s.token_ids), ps)
            - pages_for(s.num_computed_tokens, ps)
            + self._fork_pages(s)
            for s in self.running
            if s.num_pending_tokens > 1 or s.pending_forks
        )

    def _evict_one(self) -> bool:
        if self.prefix_cache is None:
            return False
        victim = self.prefix_cache.evict_lru()
        if victim is None:
            return False
        self.runner.remove_sequence(victim)
        return True

    def _free_kv(self, seq: Sequence) -> None:
        if seq.prefix_entry is not None:
            assert self.prefix_cache is not None
            self.prefix_cache.release(seq.prefix_entry)
            seq.prefix_entry = None
        self.runner.remove_sequence(seq.seq_id)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_kv(seq)
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

    def _free_now(self, out: SchedulerOutput) -> int:
        """Free pages minus those this batch will allocate when it runs."""
        return self.runner.num_free_pages() - out.new_pages

    def _schedule_once(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Decodes, oldest first; make room by eviction, then by preempting the newest.
        while True:
            decodes = [s for s in self.running if s.num_pending_tokens == 1]
            need = sum(self._new_pages(s, 1) + self._fork_pages(s) for s in decodes)
            if need <= self.runner.num_free_pages() or not self.running:
                break
            if not self._evict_one():
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
        for s in decodes:
            out.new_pages += self._new_pages(s, 1) + self._fork_pages(s)
            out.items.append(ScheduledItem(s, [s.token_ids[-1]], sample=True))
            s.num_computed_tokens += 1
            budget -= 1
            out.num_decode_tokens += 1
        scheduled = {s.seq_id for s in decodes}

        # 2. Running sequences part-way through their prefill, FCFS.
        for s in self.running:
            if budget <= 0:
                break
            if s.seq_id not in scheduled and s.num_pending_tokens > 1:
                budget = self._schedule_chunk(out, s, budget)

        # 3. Admit waiting sequences, FCFS; the head blocks the rest so nobody overtakes.
        # Not in a step that had to preempt: the victim would be readmitted straight away.
        while self.waiting and budget > 0 and not out.preempted:
            s = self.waiting[0]
            if len(self.running) + 1 + s.pending_forks > self.max_num_seqs:
                break
            if not self._admit(s, out):
                break
            self.waiting.popleft()
            budget = self._schedule_chunk(out, s, budget)
        return out

    def _schedule_chunk(self, out: SchedulerOutput, s: Sequence, budget: int) -> int:
        ps = self.runner.page_size
        pending = s.num_pending_tokens
        free = self._free_now(out)
        c = s.num_computed_tokens
        room = pages_for(c, ps) * ps - c + max(free, 0) * ps  # tokens that fit in pages
        chunk = min(pending, self.config.prefill_chunk_size, budget, room)
        if chunk == pending and self._new_pages(s, chunk) + self._fork_pages(s) > free:
            chunk -= 1  # the fork copies do not fit yet; finish the prompt next step
        if chunk <= 0:
            return budget
        sample = chunk == pending
        out.new_pages += self._new_pages(s, chunk) + (self._fork_pages(s) if sample else 0)
        out.items.append(ScheduledItem(s, s.token_ids[c : c + chunk], sample=sample))
        s.num_computed_tokens += chunk
        out.num_prefill_tokens += chunk
        return budget - chunk

    def _admit(self, s: Sequence, out: SchedulerOutput, use_cache: bool = True) -> bool:
        """Give `s` KV (forking from the prefix cache when it can) if its prompt will fit."""
        ps = self.runner.page_size
        cache = self.prefix_cache
        match_id, matched = None, 0
        if cache is not None and use_cache:
            # All but the last token, so something is left to prefill and sample from.
            m = cache.match(s.token_ids[:-1])
            match_id, matched = m.seq_id, m.num_tokens
            if match_id is not None:
                cache.acquire(match_id)  # evicting below must not take the entry we fork
        need = (
            pages_for(len(s.token_ids), ps)
            - matched // ps
            + self._fork_pages(s)
            + self._outstanding_prefill_pages()
            + self.config.reserve_pages
        )
        while need > self._free_now(out):
            if not self._evict_one():
                if match_id is None:
                    return False
                cache.release(match_id)  # type: ignore[union-attr]
                # With nothing running, only the matched entry's own pages can be in the way
                # (it may hold far more than the shared prefix): drop the match, not the request.
                return not self.running and self._admit(s, out, use_cache=False)
        if match_id is not None:
            self.runner.fork_sequence(match_id, s.seq_id, matched)
            s.prefix_entry = match_id
            self.prefix_hit_tokens += matched
        else:
            self.runner.add_sequence(s.seq_id)
        s.num_computed_tokens = matched
        s.num_cached_tokens = matched
        s.status = SequenceStatus.RUNNING
        bisect.insort(self.running, s, key=lambda q: q.order)
        return True

    # -- after the forward -------------------------------------------------------------------

    def fork_children(self, parent: Sequence) -> list[Sequence]:
        """Fork the n-1 siblings off a sequence whose prompt was just prefilled.

        The children share the parent's full prompt pages; the runner copies the partial last
        page (the scheduler already counted those copies when it scheduled the last chunk).
        """
        children = []
        for _ in range(parent.pending_forks):
            child = Sequence(
                seq_id=next(self._seq_ids),
                request=parent.request,
                index=parent.index + 1 + len(children),
                token_ids=list(parent.token_ids),
                prompt_len=parent.prompt_len,
                status=SequenceStatus.RUNNING,
                num_computed_tokens=parent.num_computed_tokens,
                num_cached_tokens=parent.num_cached_tokens,
            )
            self.runner.fork_sequence(parent.seq_id, child.seq_id, parent.num_computed_tokens)
            bisect.insort(self.running, child, key=lambda q: q.order)
            children.append(child)
        parent.pending_forks = 0
        return children

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire a sequence; its KV becomes a prefix-cache entry unless it was aborted."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release_kv(seq, keep=reason != "abort")
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.pending_forks = 0

    def _release_kv(self, seq: Sequence, keep: bool) -> None:
        cache = self.prefix_cache
        if cache is None or not keep:
            self._free_kv(seq)
            return
        if seq.prefix_entry is not None:
            # Release first so the entry we forked from can be dropped as redundant.
            cache.release(seq.prefix_entry)
            seq.prefix_entry = None
        n = seq.num_computed_tokens
        res = cache.insert(seq.token_ids[:n], seq.seq_id)
        for victim in res.evicted:
            self.runner.remove_sequence(victim)
        if res.inserted:
            if n > res.num_tokens:
                self.runner.popn(seq.seq_id, n - res.num_tokens)  # entries hold whole pages
        elif seq.seq_id not in res.evicted:
            self.runner.remove_sequence(seq.seq_id)
        seq.num_computed_tokens = 0

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Finish every live sequence of a request with reason "abort", freeing its KV."""
        seqs = [s for s in (*self.running, *self.waiting) if s.request.request_id == request_id]
        for s in seqs:
            self.finish(s, "abort")
        return seqs

    def stats(self) -> SchedulerStats:
        r = self.runner
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_preemptions=self.num_preemptions,
            kv_pages_used=r.num_pages - r.num_free_pages(),
            kv_pages_total=r.num_pages,
            prefix_cache_hit_tokens=self.prefix_hit_tokens,
            prefix_cache_tokens=self.prefix_cache.total_tokens if self.prefix_cache else 0,
        )
