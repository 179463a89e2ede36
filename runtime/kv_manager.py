"""KV-cache accounting: how many pages sequences hold and will take, and the prefix cache.

The scheduler decides which tokens run; this manager answers whether their KV fits and is the
only caller of the runner's KV lifecycle (`KVBackend`: add, fork, remove, popn).

Pages are predicted, not discovered: a sequence of L tokens holds ceil(L / page_size) pages,
so appending k tokens costs ceil((L+k)/ps) - ceil(L/ps) new ones. Pages shared with a fork
parent are never written again, because forks from the prefix cache are page-aligned and an
n > 1 fork copies the partial page (one page per extra child). The backend allocates pages
only when a forward runs, so while the scheduler builds a batch the manager keeps the pages
that batch will take (`planned_pages`) and reports free pages net of them.

Prefix-cache entries are finished sequences whose KV the backend still holds under their seq
ids (`prefix_cache.PrefixCache` is the index); evicting one frees its pages here.
"""

from __future__ import annotations

from tallow.runtime.model_runner_protocol import KVBackend, pages_for
from tallow.runtime.prefix_cache import PrefixCache, PrefixMatch
from tallow.runtime.request import SequenceState


class KVCacheManager:
    def __init__(
        self,
        backend: KVBackend,
        *,
        enable_prefix_cache: bool = True,
        prefix_cache_max_tokens: int = 8192,
    ) -> None:
        self._backend = backend
        self.page_size = backend.page_size
        self.num_pages = backend.num_pages
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(self.page_size, prefix_cache_max_tokens) if enable_prefix_cache else None
        )
        # Prefix-cache entry each live sequence forked from; referenced until its KV goes.
        self._forked_from: dict[int, int] = {}
        self.planned_pages = 0  # pages the batch being scheduled will allocate when it runs
        # Speculative proposals in the cache that verification has not settled (seq_id ->
        # count): beyond `num_computed_tokens` until it does.
        self._unverified: dict[int, int] = {}
        self.prefix_hit_tokens = 0  # total prompt tokens served from the prefix cache

    # -- accounting ------------------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def append_pages(self, seq: SequenceState, num_tokens: int) -> int:
        """New pages appending `num_tokens` to what `seq` has computed takes."""
        c = seq.num_computed_tokens
        return self.pages_for(c + num_tokens) - self.pages_for(c)

    def fork_copy_pages(self, seq: SequenceState) -> int:
        """Pages the n > 1 fork after this sequence's prefill copies (one per partial page)."""
        if seq.pending_forks and seq.prompt_len % self.page_size:
            return seq.pending_forks
        return 0

    def remaining_prefill_pages(self, seq: SequenceState) -> int:
        """Pages `seq` still takes to compute every known token and fork its siblings."""
        return self.append_pages(seq, seq.num_pending_tokens) + self.fork_copy_pages(seq)

    def request_pages(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """Pages one request needs with nothing else in the cache: all of a (resumed)
        sequence, or the prompt plus the copied partial page of each extra child."""
        fork_copies = (n - 1) if prompt_len % self.page_size else 0
        return max(
            self.pages_for(prompt_len + max_tokens), self.pages_for(prompt_len) + fork_copies
        )

    def num_free_pages(self) -> int:
        """Free pages minus those the batch being scheduled will allocate."""
        return self._backend.num_free_pages() - self.planned_pages

    def num_used_pages(self) -> int:
        """Pages held right now (by running sequences and prefix-cache entries)."""
        return self.num_pages - self._backend.num_free_pages()

    def token_room(self, seq: SequenceState) -> int:
        """Tokens `seq` could append now: the rest of its last page plus every free page."""
        ps, c = self.page_size, seq.num_computed_tokens
        return self.pages_for(c) * ps - c + max(self.num_free_pages(), 0) * ps

    def begin_batch(self) -> None:
        """A new batch is being scheduled; the previous one has run (its pages are taken)."""
        self.planned_pages = 0

    def plan_append(self, seq: SequenceState, num_tokens: int, *, with_forks: bool) -> None:
        """Count the pages the batch takes for `num_tokens` of `seq` (and its fork copies)."""
        self.planned_pages += self.append_pages(seq, num_tokens)
        if with_forks:
            self.planned_pages += self.fork_copy_pages(seq)

    # -- allocation ----------------------------------------------------------------------------

    def can_allocate(self, num_pages: int) -> bool:
        """Whether `num_pages` fit, evicting idle prefix-cache entries (LRU first) to fit."""
        while num_pages > self.num_free_pages():
            if not self.evict_one():
                return False
        return True

    def admit(
        self,
        seq: SequenceState,
        extra_pages: int = 0,
        *,
        retry_without_match: bool = False,
        use_prefix_cache: bool = True,
    ) -> bool:
        """Give a waiting sequence KV if its whole prompt plus `extra_pages` fits.

        The sequence forks from the longest cached prefix of its prompt when there is one and
        then only prefills the rest. A match whose entry is itself what blocks the prompt
        (it may hold far more than the shared prefix) is dropped and the prompt admitted
        without it when `retry_without_match`. False (nothing changed) when it does not fit.
        """
        cache = self.prefix_cache if use_prefix_cache else None
        match = PrefixMatch(None, 0)
        if cache is not None:
            # All but the last token, so something is left to prefill and sample from.
            match = cache.match(seq.token_ids[:-1])
            if match.seq_id is not None:
                cache.acquire(match.seq_id)  # evicting below must not take the entry we fork
        need = (
            self.pages_for(len(seq.token_ids))
            - match.num_tokens // self.page_size
            + self.fork_copy_pages(seq)
            + extra_pages
        )
        if not self.can_allocate(need):
            if match.seq_id is None:
                return False
            cache.release(match.seq_id)  # type: ignore[union-attr]
            return retry_without_match and self.admit(seq, extra_pages, use_prefix_cache=False)
        if match.seq_id is not None:
            self._backend.fork_sequence(match.seq_id, seq.seq_id, match.num_tokens)
            self._forked_from[seq.seq_id] = match.seq_id
            self.prefix_hit_tokens += match.num_tokens
        else:
            self._backend.add_sequence(seq.seq_id)
        seq.num_computed_tokens = match.num_tokens
        seq.num_cached_tokens = match.num_tokens
        return True

    def fork(self, parent: SequenceState, child: SequenceState) -> None:
        """`child` shares the parent's computed KV (the partial last page is copied; the
        scheduler counted that copy when it planned the parent's last chunk)."""
        self._backend.fork_sequence(parent.seq_id, child.seq_id, parent.num_computed_tokens)

    # -- freeing -------------------------------------------------------------------------------

    def free(self, seq: SequenceState, *, keep_as_prefix: bool = False) -> None:
        """Drop `seq`'s KV; with `keep_as_prefix` its whole pages become a cache entry."""
        entry = self._forked_from.pop(seq.seq_id, None)
        cache = self.prefix_cache
        if entry is not None:
            # Release first so the entry we forked from can be dropped as redundant.
            cache.release(entry)  # type: ignore[union-attr]
        n = seq.num_computed_tokens
        seq.num_computed_tokens = 0
        if cache is None or not keep_as_prefix:
            self._backend.remove_sequence(seq.seq_id)
            return
        res = cache.insert(seq.token_ids[:n], seq.seq_id)
        for victim in res.evicted:
            self._backend.remove_sequence(victim)
        if res.inserted:
            if n > res.num_tokens:
                self._backend.popn(seq.seq_id, n - res.num_tokens)  # entries hold whole pages
        elif seq.seq_id not in res.evicted:
            self._backend.remove_sequence(seq.seq_id)

    def hold_proposals(self, seq: SequenceState, count: int) -> None:
        """The step appends `count` speculative proposals after `seq`'s computed tokens; they
        count as computed once verification settles them."""
        if count:
            self._unverified[seq.seq_id] = count

    def settle_proposals(self, seq: SequenceState, kept: int) -> None:
        """Verification kept the first `kept` of `seq`'s proposals (now in its `token_ids`);
        the rest leave the cache. No-op for a sequence that held none."""
        proposed = self._unverified.pop(seq.seq_id, 0)
        if not 0 <= kept <= proposed:
            raise ValueError(f"kept {kept} of {proposed} proposals")
        if proposed > kept:
            self._backend.popn(seq.seq_id, proposed - kept)
        seq.num_computed_tokens += kept

    def evict_one(self) -> bool:
        """Free the least recently used idle prefix-cache entry; False when there is none."""
        if self.prefix_cache is None:
            return False
        victim = self.prefix_cache.evict_lru()
        if victim is None:
            return False
        self._backend.remove_sequence(victim)
        return True

    def evict_all(self) -> int:
        """Free every idle prefix-cache entry; returns how many went."""
        count = 0
        while self.evict_one():
            count += 1
        return count

    @property
    def prefix_cache_tokens(self) -> int:
        return self.prefix_cache.total_tokens if self.prefix_cache is not None else 0
