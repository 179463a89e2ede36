"""Prefix cache: finished sequences' KV kept alive and indexed by a radix tree of token pages.

Each tree edge is one page worth of token ids, keyed by the exact tuple of ids (so a lookup
compares tokens; there is no hash-only identity that a collision could fool). An *entry* is a
finished sequence whose KV the runner still holds under its seq id; every node on the entry's
path records the entry, so any entry found at the deepest matched node holds the whole matched
prefix. A new request forks from that entry at a page-aligned position (full pages are shared
by the runner, nothing is copied) and prefills only the rest.

This module only keeps the index: eviction returns seq ids and the scheduler tells the runner
to free them, so the tree is testable on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    parent: _Node | None
    key: tuple[int, ...] | None  # page of token ids on the edge from the parent
    depth: int  # pages from the root
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    entries: set[int] = field(default_factory=set)  # entry seq ids whose path passes here


@dataclass
class CacheEntry:
    seq_id: int
    num_tokens: int  # page-aligned
    leaf: _Node
    ref_count: int = 0  # live sequences forked from this entry; >0 means not evictable
    last_used: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    seq_id: int | None  # entry to fork from, or None when nothing matched
    num_tokens: int  # page-aligned number of leading tokens it holds


@dataclass
class InsertResult:
    inserted: bool  # False: the caller must free the sequence itself
    num_tokens: int  # tokens the entry keeps (page-aligned); the caller pops the rest
    evicted: list[int] = field(default_factory=list)  # seq ids the caller must free


class PrefixCache:
    def __init__(self, page_size: int, max_tokens: int) -> None:
        self.page_size = page_size
        self.max_tokens = max_tokens
        self._root = _Node(parent=None, key=None, depth=0)
        # Insertion/use order; the first unreferenced entry is the least recently used.
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self.total_tokens = 0
        self._tick = 0

    def _touch(self, seq_id: int) -> None:
        self._tick += 1
        self._entries[seq_id].last_used = self._tick
        self._entries.move_to_end(seq_id)

    # -- queries -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._entries

    def entry(self, seq_id: int) -> CacheEntry:
        return self._entries[seq_id]

    def entry_ids(self) -> list[int]:
        """Entries from least to most recently used."""
        return list(self._entries)

    def num_evictable(self) -> int:
        return sum(1 for e in self._entries.values() if e.ref_count == 0)

    def _blocks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i : i + ps]) for i in range(0, len(tokens) - ps + 1, ps)]

    def _walk(self, tokens: list[int]) -> _Node:
        node = self._root
        for block in self._blocks(tokens):
            child = node.children.get(block)
            if child is None:
                break
            node = child
        return node

    def match(self, tokens: list[int]) -> PrefixMatch:
        """Longest page-aligned cached prefix of `tokens`; marks the entry used.

        Pass all but the last token of a prompt so at least one token is left to prefill.
        """
        node = self._walk(tokens)
        if node is self._root:
            return PrefixMatch(None, 0)
        # Prefer the most recently used holder: it is the least likely to be evicted next.
        seq_id = max(node.entries, key=lambda s: self._entries[s].last_used)
        self._touch(seq_id)
        return PrefixMatch(seq_id, node.depth * self.page_size)

    # -- references --------------------------------------------------------------------------

    def acquire(self, seq_id: int) -> None:
        self._entries[seq_id].ref_count += 1

    def release(self, seq_id: int) -> None:
        entry = self._entries.get(seq_id)
        # An entry can be evicted as redundant while referenced only if the caller erred.
        assert entry is not None and entry.ref_count > 0, f"release of unreferenced {seq_id}"
        entry.ref_count -= 1

    # -- insert / evict ----------------------------------------------------------------------

    def insert(self, tokens: list[int], seq_id: int) -> InsertResult:
        """Offer a finished sequence whose KV holds exactly `tokens` as a cache entry.

        Only whole pages are kept (the caller pops the partial tail from the runner). Nothing
        is inserted when the tree already holds every page of it or it alone exceeds the cap.
        """
        if seq_id in self._entries:
            raise ValueError(f"sequence {seq_id} is already a cache entry")
        blocks = self._blocks(tokens)
        n_tokens = len(blocks) * self.page_size
        if not blocks or n_tokens > self.max_tokens:
            return InsertResult(False, 0)
        node = self._root
        path: list[_Node] = []
        for block in blocks:
            child = node.children.get(block)
            if child is None:
                child = _Node(parent=node, key=block, depth=node.depth + 1)
                node.children[block] = child
            node = child
            path.append(node)
        if node.entries:
            # Some entry already holds every page of this one; nothing new to keep.
            return InsertResult(False, 0)
        for n in path:
            n.entries.add(seq_id)
        self._entries[seq_id] = CacheEntry(seq_id=seq_id, num_tokens=n_tokens, leaf=node)
        self._touch(seq_id)
        self.total_tokens += n_tokens
        evicted: list[int] = []
        # Entries ending on this path are strict prefixes of the new one; their pages are
        # shared with it in the runner, so they only cost token budget. Drop the idle ones.
        for n in path[:-1]:
            for other in list(n.entries):
                e = self._entries[other]
                if e.leaf is n and e.ref_count == 0:
                    self._remove(other)
                    evicted.append(other)
        while self.total_tokens > self.max_tokens:
            victim = self.evict_lru()
            if victim is None:
                break  # everything left is referenced; the cap is soft until they release
            evicted.append(victim)
        inserted = seq_id in self._entries
        return InsertResult(inserted, n_tokens if inserted else 0, evicted)

    def evict_lru(self) -> int | None:
        """Drop the least recently used unreferenced entry; return its seq id (or None)."""
        for seq_id, entry in self._entries.items():
            if entry.ref_count == 0:
                self._remove(seq_id)
                return seq_id
        return None

    def _remove(self, seq_id: int) -> None:
        entry = self._entries.pop(seq_id)
        self.total_tokens -= entry.num_tokens
        node: _Node | None = entry.leaf
        while node is not None and node.parent is not None:
            node.entries.discard(seq_id)
            parent = node.parent
            # A node with no entries has none below it either (entries mark whole paths).
            if not node.entries:
                del parent.children[node.key]  # type: ignore[index]
            node = parent
