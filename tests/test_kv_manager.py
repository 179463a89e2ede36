"""The KV-cache manager against the fake runner, whose page pool is real: every prediction the
manager makes is checked against pages the fake actually hands out."""

from __future__ import annotations

import random
import sys

import numpy as np

from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.kv_manager import KVCacheManager
from tallow.runtime.model_runner_protocol import KVBackend, ModelExecutor, ModelRunner
from tallow.runtime.request import Request, SequenceState, SequenceStatus
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.scheduler import Scheduler, SchedulerConfig

PS = 4  # tokens per page


def ceil_pages(tokens: int) -> int:
    """The test's own count, independent of `pages_for`."""
    return (tokens + PS - 1) // PS


def make(num_pages=32, prefix=True, max_tokens=64) -> tuple[KVCacheManager, FakeModelRunner]:
    runner = FakeModelRunner(page_size=PS, num_pages=num_pages, context_window=256)
    kv = KVCacheManager(runner, enable_prefix_cache=prefix, prefix_cache_max_tokens=max_tokens)
    return kv, runner


_ids = iter(range(10**6))


def seq_of(tokens: list[int], n: int = 1) -> SequenceState:
    req = Request(f"r{len(tokens)}", list(tokens), SamplingParams(max_tokens=8, n=n), 0)
    return SequenceState(next(_ids), req, 0, list(tokens), len(tokens), pending_forks=n - 1)


def prefill(kv: KVCacheManager, runner: FakeModelRunner, seq: SequenceState) -> None:
    """What the scheduler and engine do for one whole prompt: plan, then forward."""
    kv.begin_batch()
    pending = seq.token_ids[seq.num_computed_tokens :]
    kv.plan_append(seq, len(pending), with_forks=True)
    free = runner.num_free_pages()
    runner.forward([(seq.seq_id, pending)])
    assert free - runner.num_free_pages() == kv.planned_pages - kv.fork_copy_pages(seq)
    seq.num_computed_tokens = len(seq.token_ids)
    kv.begin_batch()  # the batch ran: its pages now show in the backend's own count


def test_protocol_halves():
    runner = FakeModelRunner()
    assert isinstance(runner, KVBackend) and isinstance(runner, ModelExecutor)
    assert isinstance(runner, ModelRunner)


def test_page_accounting_matches_an_independent_count():
    rng = random.Random(0)
    kv, runner = make(num_pages=64, prefix=False)
    live: list[SequenceState] = []
    for _ in range(40):
        if live and rng.random() < 0.3:
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            s = seq_of([rng.randrange(100) for _ in range(rng.randint(1, 20))])
            assert kv.admit(s)
            assert kv.append_pages(s, len(s.token_ids)) == ceil_pages(len(s.token_ids))
            prefill(kv, runner, s)
            live.append(s)
        held = sum(ceil_pages(len(s.token_ids)) for s in live)
        assert kv.num_used_pages() == held
        assert runner.num_free_pages() == runner.num_pages - held
    for s in live:
        kv.free(s)
    assert runner.num_free_pages() == runner.num_pages and runner.sequence_ids() == []


def test_append_pages_counts_page_boundaries():
    kv, _ = make()
    s = seq_of([1] * 10)
    for computed in range(10):
        s.num_computed_tokens = computed
        for k in range(1, 10):
            assert kv.append_pages(s, k) == ceil_pages(computed + k) - ceil_pages(computed)


def test_prefix_hit_reuses_pages():
    kv, runner = make()
    shared = list(range(1, 13))  # three full pages
    a = seq_of(shared + [50, 51])
    assert kv.admit(a)
    prefill(kv, runner, a)
    kv.free(a, keep_as_prefix=True)  # the three whole pages stay as an entry, the tail goes
    assert kv.prefix_cache is not None and kv.prefix_cache.entry_ids() == [a.seq_id]
    assert kv.num_used_pages() == 3 and kv.prefix_cache_tokens == 12
    b = seq_of(shared + [60, 61, 62])
    free = runner.num_free_pages()
    assert kv.admit(b)
    assert runner.num_free_pages() == free  # forked: the shared pages are not copied
    assert b.num_computed_tokens == b.num_cached_tokens == 12 and kv.prefix_hit_tokens == 12
    prefill(kv, runner, b)
    assert runner.sequence_tokens(b.seq_id) == b.token_ids
    assert kv.num_used_pages() == 3 + 1  # b's own page holds only its 3 new tokens
    kv.free(b)
    kv.evict_all()
    assert runner.num_free_pages() == runner.num_pages


def test_fork_shares_full_pages_and_copies_a_partial_one():
    kv, runner = make(prefix=False)
    aligned = seq_of(list(range(8)), n=2)
    assert kv.admit(aligned)
    assert kv.fork_copy_pages(aligned) == 0
    prefill(kv, runner, aligned)
    free = runner.num_free_pages()
    child = seq_of(aligned.token_ids)
    kv.fork(aligned, child)
    assert runner.num_free_pages() == free
    partial = seq_of(list(range(6)), n=3)
    assert kv.admit(partial)
    assert kv.fork_copy_pages(partial) == 2  # one copied partial page per extra child
    prefill(kv, runner, partial)
    free = runner.num_free_pages()
    kids = [seq_of(partial.token_ids) for _ in range(2)]
    for k in kids:
        kv.fork(partial, k)
    assert runner.num_free_pages() == free - 2
    assert all(runner.sequence_tokens(k.seq_id) == partial.token_ids for k in kids)
    for s in (aligned, child, partial, *kids):
        kv.free(s)
    assert runner.num_free_pages() == runner.num_pages


def test_eviction_frees_least_recently_used_entries_first():
    kv, runner = make(num_pages=32, max_tokens=64)
    entries = []
    for start in (10, 30, 50):
        s = seq_of(list(range(start, start + 8)))
        assert kv.admit(s)
        prefill(kv, runner, s)
        kv.free(s, keep_as_prefix=True)
        entries.append(s.seq_id)
    # A hit on the oldest entry makes the second one least recently used.
    user = seq_of(list(range(10, 18)) + [99])
    assert kv.admit(user) and user.num_cached_tokens == 8
    kv.free(user)
    assert kv.evict_one()
    assert runner.sequence_ids() == sorted([entries[0], entries[2]])
    assert kv.evict_one()
    assert runner.sequence_ids() == [entries[0]]
    assert kv.evict_all() == 1 and not kv.evict_one()
    assert runner.num_free_pages() == runner.num_pages


def test_entries_in_use_are_not_evicted():
    kv, runner = make()
    a = seq_of(list(range(8)))
    assert kv.admit(a)
    prefill(kv, runner, a)
    kv.free(a, keep_as_prefix=True)
    b = seq_of(list(range(8)) + [7])
    assert kv.admit(b) and b.num_cached_tokens == 8
    assert not kv.evict_one()  # b forked from the entry
    kv.free(b)
    assert kv.evict_one()


def test_out_of_pages_is_reported_not_raised():
    kv, runner = make(num_pages=4, prefix=True)
    big = seq_of(list(range(12)))  # 3 pages
    assert kv.admit(big)
    prefill(kv, runner, big)
    before = (runner.num_free_pages(), runner.sequence_ids())
    too_big = seq_of(list(range(50, 58)))  # 2 pages, 1 free
    assert not kv.admit(too_big)
    assert not kv.can_allocate(2)
    assert (runner.num_free_pages(), runner.sequence_ids()) == before
    assert too_big.num_computed_tokens == 0
    # The finished sequence's entry is idle, so it can be evicted to make room.
    kv.free(big, keep_as_prefix=True)
    assert kv.num_used_pages() == 3
    assert kv.admit(too_big)
    assert kv.prefix_cache is not None and len(kv.prefix_cache) == 0


def test_a_matched_entry_in_the_way_is_dropped_only_when_allowed():
    kv, runner = make(num_pages=6, max_tokens=64)
    a = seq_of(list(range(20)))  # 5 pages, all kept as an entry
    assert kv.admit(a)
    prefill(kv, runner, a)
    kv.free(a, keep_as_prefix=True)
    b = seq_of(list(range(4)) + list(range(60, 80)))  # shares 1 page, needs 5 more
    assert not kv.admit(b)
    assert kv.admit(b, retry_without_match=True)
    assert b.num_cached_tokens == 0 and runner.sequence_ids() == [b.seq_id]


class RecordingRunner(FakeModelRunner):
    """Records which module calls each KV lifecycle method."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.kv_callers: set[str] = set()

    def _record(self) -> None:
        self.kv_callers.add(sys._getframe(2).f_globals["__name__"])

    def add_sequence(self, seq_id):
        self._record()
        super().add_sequence(seq_id)

    def fork_sequence(self, parent_id, child_id, fork_pos):
        self._record()
        super().fork_sequence(parent_id, child_id, fork_pos)

    def remove_sequence(self, seq_id):
        self._record()
        super().remove_sequence(seq_id)

    def popn(self, seq_id, n):
        self._record()
        super().popn(seq_id, n)


def test_only_the_kv_manager_calls_the_runners_kv_lifecycle():
    runner = RecordingRunner(page_size=PS, num_pages=24, vocab_size=101, context_window=256)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, prefill_chunk_size=8)
    engine = Engine(runner, scheduler_config=config)
    # The scheduler keeps no handle on the runner at all: its KV goes through `kv`.
    assert not any(v is runner for v in vars(engine.scheduler).values())
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(1, 100, 12)]
    prompts = [shared + [int(t) for t in rng.integers(1, 100, 1 + i % 5)] for i in range(10)]
    params = [
        SamplingParams(max_tokens=12, temperature=0.7, n=1 + i % 3, seed=i) for i in range(10)
    ]
    engine.generate(prompts, params)
    assert engine.stats().num_preemptions > 0 and engine.stats().prefix_cache_hit_tokens > 0
    assert runner.kv_callers == {KVCacheManager.__module__}
    engine.scheduler.kv.evict_all()
    assert runner.num_free_pages() == runner.num_pages


def test_abort_all_frees_everything_and_empties_the_queues():
    runner = FakeModelRunner(page_size=PS, num_pages=32)
    sched = Scheduler(runner, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))
    seqs = []
    for i in range(6):
        req = Request(f"r{i}", list(range(1 + i, 12 + i)), SamplingParams(max_tokens=4), i)
        seqs.append(sched.add_request(req))
    out = sched.schedule()
    runner.forward(out.forward_items)
    assert sched.running and sched.waiting
    sched.abort_all()
    assert not sched.has_work()
    assert all(s.status is SequenceStatus.FINISHED and s.finish_reason == "abort" for s in seqs)
    assert runner.num_free_pages() == runner.num_pages and runner.sequence_ids() == []
