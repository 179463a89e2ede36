"""A numpy stand-in for the TVM model runner, honest enough to catch bookkeeping bugs.

Two properties make it useful as a test oracle:

* Page accounting is real: a pool of `num_pages` pages with refcounts, shared on fork, copied
  when a fork lands mid-page, freed when the last holder goes. Asking for a page that is not
  free raises `OutOfPagesError` instead of silently growing, exactly where TVM's cache would
  fail, so the scheduler's predictions are checked on every step.
* Logits depend on the token contents *stored in the sequence's pages* (not on a side list),
  hashed into a seed. If the engine forks from the wrong cached prefix, loses tokens when it
  preempts, or re-feeds a token twice, the KV contents differ and so do the outputs.

Hidden states (`forward_hidden`, for embeddings) follow the same rule: a token's row is drawn
from a hash of the sequence's stored tokens up to and including it, so `reference_hidden`
predicts them and a chunked prefill yields the same rows as a whole one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from tallow.runtime.model_runner_protocol import OutOfPagesError, SamplingControls, pages_for
from tallow.runtime.sampler import sample_controls


@dataclass
class _FakeSeq:
    pages: list[int] = field(default_factory=list)
    length: int = 0


class FakeModelRunner:
    """Implements `model_runner_protocol.ModelRunner` (both its KV and its execute half)."""

    def __init__(
        self,
        *,
        page_size: int = 16,
        num_pages: int = 64,
        vocab_size: int = 101,
        context_window: int = 512,
        max_batch_size: int = 32,
        prefill_chunk_size: int = 2048,
        seed: int = 0,
        device_sampling: bool = True,
        hidden_size: int = 16,
        embedding_pooling: str | None = "mean",
        generation: bool = True,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.vocab_size = vocab_size
        self.context_window = context_window
        self.max_batch_size = max_batch_size
        self.prefill_chunk_size = prefill_chunk_size  # most tokens per forward, as in TVM
        self._seed = seed
        self._refcount = [0] * num_pages
        self._page_tokens: list[list[int]] = [[] for _ in range(num_pages)]
        # Lowest page ids first so runs are reproducible.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._seqs: dict[int, _FakeSeq] = {}
        # Observability for tests: every forward's items, and total tokens appended.
        self.forward_log: list[list[tuple[int, list[int]]]] = []
        self.tokens_computed = 0
        # `sample` stands in for the compiled sampler with its numpy twin.
        self.supports_device_sampling = device_sampling
        self.device_sampled_rows = 0
        self._last_logits: np.ndarray | None = None
        self.hidden_size = hidden_size
        self.embedding_pooling = embedding_pooling  # None: no hidden states, as old artifacts
        self.supports_generation = generation  # False: an embedding-only artifact
        self.hidden_log: list[list[tuple[int, list[int]]]] = []  # forward_hidden's items

    # -- page pool ---------------------------------------------------------------------------

    def num_free_pages(self) -> int:
        return len(self._free)

    def _alloc(self) -> int:
        if not self._free:
            raise OutOfPagesError(f"KV cache out of pages (all {self.num_pages} in use)")
        page = self._free.pop()
        assert self._refcount[page] == 0
        self._refcount[page] = 1
        self._page_tokens[page] = []
        return page

    def _decref(self, page: int) -> None:
        assert self._refcount[page] > 0, f"page {page} freed twice"
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            self._page_tokens[page] = []
            self._free.append(page)

    def _seq(self, seq_id: int) -> _FakeSeq:
        if seq_id not in self._seqs:
            raise KeyError(f"sequence {seq_id} does not exist in the KV cache")
        return self._seqs[seq_id]

    # -- sequence lifecycle ------------------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        self._seqs[seq_id] = _FakeSeq()

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int) -> None:
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} already exists")
        if not 0 <= fork_pos <= parent.length:
            raise ValueError(f"fork_pos {fork_pos} outside parent length {parent.length}")
        n_full, rem = divmod(fork_pos, self.page_size)
        if rem and not self._free:
            raise OutOfPagesError("no free page to copy the partial page of a fork")
        child = _FakeSeq(pages=list(parent.pages[:n_full]), length=fork_pos)
        for page in child.pages:
            self._refcount[page] += 1
        if rem:
            copy = self._alloc()
            self._page_tokens[copy] = list(self._page_tokens[parent.pages[n_full]][:rem])
            child.pages.append(copy)
        self._seqs[child_id] = child

    def remove_sequence(self, seq_id: int) -> None:
        seq = self._seq(seq_id)
        for page in seq.pages:
            self._decref(page)
        del self._seqs[seq_id]

    def popn(self, seq_id: int, n: int) -> None:
        seq = self._seq(seq_id)
        if not 0 <= n <= seq.length:
            raise ValueError(f"cannot pop {n} tokens from a sequence of {seq.length}")
        new_len = seq.length - n
        keep = pages_for(new_len, self.page_size)
        for page in seq.pages[keep:]:
            self._decref(page)
        del seq.pages[keep:]
        seq.length = new_len
        if seq.pages and new_len % self.page_size:
            last = seq.pages[-1]
            if self._refcount[last] == 1:
                del self._page_tokens[last][new_len % self.page_size :]
            # A shared partial page is left as is; _append copies it before writing.

    # -- forward -----------------------------------------------------------------------------

    def _pages_needed(self, seq: _FakeSeq, n_new: int) -> int:
        need = pages_for(seq.length + n_new, self.page_size) - len(seq.pages)
        if seq.length % self.page_size and self._refcount[seq.pages[-1]] > 1:
            need += 1  # copy-on-write of a shared partial page
        return need

    def _append(self, seq: _FakeSeq, tokens: list[int]) -> None:
        ps = self.page_size
        for tok in tokens:
            off = seq.length % ps
            if off == 0:
                seq.pages.append(self._alloc())
            elif self._refcount[seq.pages[-1]] > 1:
                old = seq.pages[-1]
                new = self._alloc()
                self._page_tokens[new] = list(self._page_tokens[old][:off])
                self._decref(old)
                seq.pages[-1] = new
            page_toks = self._page_tokens[seq.pages[-1]]
            del page_toks[off:]  # stale tail left by popn on an owned page
            page_toks.append(tok)
            seq.length += 1

    def _history(self, seq: _FakeSeq) -> list[int]:
        toks: list[int] = []
        for page in seq.pages:
            toks.extend(self._page_tokens[page])
        return toks[: seq.length]

    def _logits(self, history: list[int]) -> np.ndarray:
        data = np.asarray([self._seed, *history], dtype=np.int64).tobytes()
        digest = hashlib.blake2b(data, digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        return rng.standard_normal(self.vocab_size).astype(np.float32) * 3.0

    def sample(self, controls: SamplingControls) -> np.ndarray:
        if not self.supports_device_sampling or self._last_logits is None:
            raise RuntimeError("sample() needs device sampling and a forward before it")
        self.device_sampled_rows += len(controls.temperature)
        return sample_controls(self._last_logits, controls)

    def _hidden_row(self, history: list[int]) -> np.ndarray:
        data = np.asarray([self._seed, -1, *history], dtype=np.int64).tobytes()
        digest = hashlib.blake2b(data, digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        return rng.standard_normal(self.hidden_size).astype(np.float32)

    def forward(self, items: list[tuple[int, list[int]]], num_logits=None) -> np.ndarray:
        if not self.supports_generation:
            raise RuntimeError("an embedding-only runner has no logits")
        self._check_items(items)
        counts = [1] * len(items) if num_logits is None else list(num_logits)
        if not all(1 <= c <= len(t) for c, (_, t) in zip(counts, items, strict=True)):
            raise ValueError("num_logits: between 1 and the item's token count")
        self.forward_log.append([(sid, list(toks)) for sid, toks in items])
        out = []
        for (sid, toks), count in zip(items, counts, strict=True):
            seq = self._seqs[sid]
            self._append(seq, toks)
            self.tokens_computed += len(toks)
            history = self._history(seq)
            out += [self._logits(history[: len(history) - i]) for i in range(count - 1, -1, -1)]
        logits = np.stack(out) if out else np.zeros((0, self.vocab_size), np.float32)
        self._last_logits = logits
        return logits

    def forward_prompt_logits(self, items: list[tuple[int, list[int]]]) -> list[np.ndarray]:
        if not self.supports_generation:
            raise RuntimeError("an embedding-only runner has no logits")
        return self._rows_per_token(items, self.forward_log, self._logits)

    def forward_hidden(self, items: list[tuple[int, list[int]]]) -> list[np.ndarray]:
        if self.embedding_pooling is None:
            raise RuntimeError("this runner has no hidden-state function")
        return self._rows_per_token(items, self.hidden_log, self._hidden_row)

    def _rows_per_token(self, items, log: list, row) -> list[np.ndarray]:
        """Feed each item's tokens and return `row(history up to the token)` for every one."""
        self._check_items(items)
        log.append([(sid, list(toks)) for sid, toks in items])
        out = []
        for sid, toks in items:
            seq = self._seqs[sid]
            self._append(seq, toks)
            self.tokens_computed += len(toks)
            history = self._history(seq)
            start = len(history) - len(toks)
            out.append(np.stack([row(history[: start + i + 1]) for i in range(len(toks))]))
        return out

    def _check_items(self, items: list[tuple[int, list[int]]]) -> None:
        if len(items) > self.max_batch_size:
            raise ValueError(f"batch of {len(items)} exceeds max_batch_size")
        if sum(len(toks) for _, toks in items) > self.prefill_chunk_size:
            raise ValueError(f"forward carries more than {self.prefill_chunk_size} tokens")
        ids = [sid for sid, _ in items]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a sequence appears twice in one forward: {ids}")
        need = 0
        for sid, toks in items:
            seq = self._seq(sid)
            if not toks:
                raise ValueError(f"empty token list for sequence {sid}")
            if any(not 0 <= t < self.vocab_size for t in toks):
                raise ValueError(f"token id out of range for sequence {sid}")
            if seq.length + len(toks) > self.context_window:
                raise ValueError(f"sequence {sid} would exceed the context window")
            need += self._pages_needed(seq, len(toks))
        if need > len(self._free):
            # Checked up front so a failed step leaves the cache untouched.
            raise OutOfPagesError(f"forward needs {need} pages, {len(self._free)} free")

    # -- test helpers ------------------------------------------------------------------------

    def sequence_ids(self) -> list[int]:
        return sorted(self._seqs)

    def sequence_tokens(self, seq_id: int) -> list[int]:
        return self._history(self._seq(seq_id))

    def reference_logits(self, tokens: list[int]) -> np.ndarray:
        """Logits a sequence holding exactly `tokens` would produce (for oracles in tests)."""
        return self._logits(list(tokens))

    def reference_hidden(self, tokens: list[int]) -> np.ndarray:
        """Hidden states [len(tokens), hidden_size] a sequence holding `tokens` would yield."""
        return np.stack([self._hidden_row(list(tokens[: i + 1])) for i in range(len(tokens))])
