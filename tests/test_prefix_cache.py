"""Radix-tree prefix cache: exact token matching, page alignment, LRU, refcounts, token cap."""

from __future__ import annotations

import pytest

from tallow.runtime.prefix_cache import PrefixCache

PS = 4


def toks(*blocks: int, extra: int = 0) -> list[int]:
    """Page-sized blocks [b, b, b, b] (distinct per b) plus `extra` tail tokens."""
    out = [b * 10 + i for b in blocks for i in range(PS)]
    return out + [999 - i for i in range(extra)]


def test_insert_then_match_is_page_aligned():
    pc = PrefixCache(PS, max_tokens=1000)
    res = pc.insert(toks(1, 2, 3, extra=2), seq_id=7)
    assert res.inserted and res.num_tokens == 3 * PS and res.evicted == []
    assert pc.total_tokens == 12
    m = pc.match(toks(1, 2, extra=3))
    assert (m.seq_id, m.num_tokens) == (7, 8)
    m = pc.match(toks(1, 2, 3, 4))
    assert (m.seq_id, m.num_tokens) == (7, 12)
    # Fewer than a page of the first block: nothing usable.
    assert pc.match(toks(1)[:3]).seq_id is None


def test_match_compares_every_token():
    pc = PrefixCache(PS, max_tokens=1000)
    pc.insert(toks(1, 2, 3), seq_id=1)
    query = toks(1, 2, 3)
    query[6] += 1  # one token differs inside the second page
    m = pc.match(query)
    assert (m.seq_id, m.num_tokens) == (1, 4)
    query = toks(1, 2, 3)
    query[0] += 1
    assert pc.match(query).seq_id is None


def test_branching_picks_deepest_holder():
    pc = PrefixCache(PS, max_tokens=1000)
    pc.insert(toks(1, 2, 3), seq_id=1)
    pc.insert(toks(1, 5, 6, 7), seq_id=2)
    assert pc.match(toks(1, 5, 6)) == pc.match(toks(1, 5, 6, 9))
    assert pc.match(toks(1, 5, 6)).seq_id == 2
    assert pc.match(toks(1, 2, 9)).seq_id == 1
    assert pc.match(toks(1, 9)).num_tokens == 4  # both hold page 1; either is fine
    assert len(pc) == 2 and pc.total_tokens == 28


def test_short_or_covered_sequences_are_not_inserted():
    pc = PrefixCache(PS, max_tokens=10)
    assert not pc.insert(toks(1)[:3], seq_id=1).inserted  # less than a page
    assert not pc.insert(toks(1, 2, 3), seq_id=2).inserted  # 12 tokens > cap of 10
    pc = PrefixCache(PS, max_tokens=100)
    assert pc.insert(toks(1, 2, 3), seq_id=3).inserted
    # Every page already held by entry 3: nothing new.
    assert not pc.insert(toks(1, 2, extra=3), seq_id=4).inserted
    assert pc.entry_ids() == [3]


def test_extension_replaces_idle_prefix_entry_but_not_a_referenced_one():
    pc = PrefixCache(PS, max_tokens=100)
    pc.insert(toks(1, 2), seq_id=1)
    res = pc.insert(toks(1, 2, 3), seq_id=2)
    assert res.inserted and res.evicted == [1]
    assert pc.entry_ids() == [2] and pc.total_tokens == 12
    pc.acquire(2)
    res = pc.insert(toks(1, 2, 3, 4), seq_id=3)
    assert res.evicted == [] and set(pc.entry_ids()) == {2, 3}
    pc.release(2)
    assert pc.evict_lru() == 2


def test_lru_order_and_touch_on_match():
    pc = PrefixCache(PS, max_tokens=100)
    for sid, b in [(1, 1), (2, 2), (3, 3)]:
        pc.insert(toks(b, b + 10), seq_id=sid)
    pc.match(toks(1, 11))  # 1 becomes most recent
    assert pc.entry_ids() == [2, 3, 1]
    assert pc.evict_lru() == 2
    assert pc.evict_lru() == 3
    assert pc.evict_lru() == 1
    assert pc.evict_lru() is None
    assert len(pc) == 0 and pc.total_tokens == 0
    assert pc.match(toks(1, 11)).seq_id is None
    assert pc._root.children == {}  # the tree is pruned when entries go


def test_refcount_blocks_eviction():
    pc = PrefixCache(PS, max_tokens=100)
    pc.insert(toks(1), seq_id=1)
    pc.insert(toks(2), seq_id=2)
    pc.acquire(1)
    pc.acquire(1)
    assert pc.num_evictable() == 1
    assert pc.evict_lru() == 2
    assert pc.evict_lru() is None
    pc.release(1)
    assert pc.evict_lru() is None
    pc.release(1)
    assert pc.evict_lru() == 1
    with pytest.raises(AssertionError):
        pc.release(1)


def test_token_cap_evicts_lru_unreferenced():
    pc = PrefixCache(PS, max_tokens=3 * PS)
    pc.insert(toks(1), seq_id=1)
    pc.insert(toks(2), seq_id=2)
    pc.insert(toks(3), seq_id=3)
    pc.acquire(1)
    res = pc.insert(toks(4, 5), seq_id=4)
    # 20 tokens > 12: 1 is referenced, so 2 then 3 go.
    assert res.inserted and res.evicted == [2, 3]
    assert pc.total_tokens == 12 and set(pc.entry_ids()) == {1, 4}
    # With nothing else evictable the newcomer itself is dropped again.
    res = pc.insert(toks(6), seq_id=5)
    assert res.evicted == [4] and res.inserted
    pc.acquire(5)
    res = pc.insert(toks(7, 8), seq_id=6)
    assert not res.inserted and res.evicted == [6]
    assert 6 not in pc and pc.total_tokens == 8


def test_match_does_not_see_partially_evicted_paths():
    pc = PrefixCache(PS, max_tokens=100)
    pc.insert(toks(1, 2, 3), seq_id=1)
    pc.insert(toks(1, 2, 4, 5), seq_id=2)
    assert pc.evict_lru() == 1
    m = pc.match(toks(1, 2, 3))
    assert (m.seq_id, m.num_tokens) == (2, 8)
