"""The contract between the engine's Python bookkeeping and whatever runs the model.

The real implementation wraps TVM's paged KV cache (vm.builtin.kv_state_* plus the compiled
prefill/decode functions); `fake_runner.FakeModelRunner` implements it in numpy for tests.
Keeping the engine behind this protocol means scheduling, prefix caching and preemption are
testable without a compiled model.

It comes in two halves: `KVBackend`, the cache's sequence lifecycle, which only the
`KVCacheManager` calls (the scheduler asks the manager; it never touches the cache), and
`ModelExecutor`, the forward and the sampler, which the engine calls with the scheduler's
output. `ModelRunner` is both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

# The artifact's compiled sampler: `sample_tokens(logits [n, vocab], controls [n, 5])`, the
# controls' columns in this order (compiler/sampler_function.py, schedules/*_sampling.py).
SAMPLER_FUNCTION = "sample_tokens"
CONTROL_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "uniform")


@dataclass
class SamplingControls:
    """Per row of the last forward's logits, what the device sampler needs (length n each).

    temperature 0 means greedy (the first maximum); top_k 0, top_p 1 and min_p 0 mean no cut;
    `uniform` is the row's draw in [0, 1), taken from its sequence's own generator.
    """

    temperature: np.ndarray  # float32
    top_k: np.ndarray  # int32
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    uniform: np.ndarray  # float32

    def packed(self) -> np.ndarray:
        """[n, 5] float32 in `CONTROL_COLUMNS` order: the kernel's input (top_k is a whole
        number, exact in float32 below 2**24)."""
        return np.stack([getattr(self, c) for c in CONTROL_COLUMNS], axis=1).astype(np.float32)


class OutOfPagesError(RuntimeError):
    """The KV cache was asked for more pages than it has free.

    The KV manager predicts page use so this never happens; a runner raising it means the
    accounting and the cache disagree, which is a bug rather than a load condition.
    """


@runtime_checkable
class KVBackend(Protocol):
    """The paged KV cache's sequence lifecycle. Only `kv_manager.KVCacheManager` calls it."""

    page_size: int  # tokens per KV page (16)
    num_pages: int  # total KV pages in the cache

    def add_sequence(self, seq_id: int) -> None:
        """Register an empty sequence; holds no pages until tokens are appended."""
        ...

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int) -> None:
        """Create `child_id` holding the parent's first `fork_pos` tokens of KV.

        Full pages are shared (refcounted, not copied); a partial last page is copied into a
        fresh page owned by the child, so a fork at a non page-aligned position costs one page.
        """
        ...

    def remove_sequence(self, seq_id: int) -> None:
        """Drop a sequence; pages whose refcount falls to zero return to the free pool."""
        ...

    def popn(self, seq_id: int, n: int) -> None:
        """Drop the last `n` tokens of KV (only tokens on pages the sequence owns alone)."""
        ...

    def num_free_pages(self) -> int:
        """Pages not referenced by any sequence."""
        ...


@runtime_checkable
class ModelExecutor(Protocol):
    """Runs the model over sequences the KV backend already knows; what the engine calls."""

    vocab_size: int
    context_window: int  # max tokens (prompt + output) per sequence
    max_batch_size: int  # most items one forward() may carry
    # Most tokens one forward() may carry in total: TVM's cache sizes its per-forward buffers
    # by it, so the scheduler's token budget per step never exceeds it.
    prefill_chunk_size: int
    # True when `sample` works: the artifact has the compiled sampler (older ones do not).
    supports_device_sampling: bool
    # False for an embedding-only artifact (`tallow compile --task embed`): no `forward`.
    supports_generation: bool
    # How `forward_hidden`'s rows become one embedding ("mean" or "last", then L2-normalised);
    # None when the runner has no hidden-state function (artifacts from before embeddings).
    embedding_pooling: str | None
    hidden_size: int  # the width of `forward_hidden`'s rows

    def forward_hidden(self, items: list[tuple[int, list[int]]]) -> list[np.ndarray]:
        """Like `forward` (append each item's tokens to its sequence's KV, run once), but
        return every fed token's final hidden state (after the last norm): one float32
        array [len(tokens), hidden_size] per item, in item order. Never mixed with `forward`
        items in one call; `sample` does not apply to it.
        """
        ...

    def forward_prompt_logits(self, items: list[tuple[int, list[int]]]) -> list[np.ndarray]:
        """Like `forward` (append each item's tokens to its sequence's KV, run once), but
        return the float32 logits after every fed token: one array [len(tokens), vocab_size]
        per item, in item order, on the host (prompt logprobs, perplexity). Never mixed with
        `forward` items in one call; `sample` does not apply to it.
        """
        ...

    def forward(
        self, items: list[tuple[int, list[int]]], num_logits: list[int] | None = None
    ) -> np.ndarray:
        """Append each item's tokens to its sequence's KV and run the model once.

        Prefill chunks and single-token decodes may be mixed. Returns float32 logits of shape
        [sum(num_logits), vocab_size]: for each item in order, the rows after its last
        `num_logits[i]` tokens (default one row, the last token's; speculative verification
        asks for every fed token's).
        """
        ...

    def sample(self, controls: SamplingControls) -> np.ndarray:
        """Token id (int) per row of the last forward's logits, drawn where the logits are.

        Temperature, top-k, top-p and min-p only; penalties, biases and logprobs need the
        logits on the host. Must be called before the next forward.
        """
        ...


@runtime_checkable
class ModelRunner(KVBackend, ModelExecutor, Protocol):
    """One loaded model with its KV cache: what `Engine` is built over."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages a sequence of `num_tokens` tokens occupies (ceil division)."""
    return -(-num_tokens // page_size)
