"""Decode batches rounded up to a few fixed sizes, so CUDA graphs exist for those sizes only.

A CUDA artifact's `batch_decode` is captured into CUDA graphs per batch size it meets
(`compiler/backends/cuda.py`: TVM's `run_or_capture` keys its graph cache on the symbolic
batch size). Without rounding, a server meeting every size from 1 to 64 captures up to 64
graphs per region; each capture costs a slow first step and device memory. Rounding the batch
up to the next bucket (the manifest's `cuda_graph.batch_buckets`, 1, 2, 4, 8, 16, 32, 64)
bounds that to seven, at the price of computing the padding rows: decode reads the weights
once whatever the row count, so a padding row costs a few more multiply-adds per weight and
its share of attention over an empty sequence.

The padding rows need sequences in the paged KV cache, since `batch_decode` appends one
token of K/V to every sequence of the step. Each padding slot owns a scratch sequence, added
once (lazily, the first time a batch needs that many slots) under an id far above any the
engine hands out. A scratch sequence is empty before a step; the step appends one token
(holding at most one page); `popn` takes it back right after, which frees that page again,
so scratch sequences never grow. Their tokens sit at position 0 of their own sequences:
attention never mixes sequences, so the real rows' logits are bit-identical with and without
padding (`tests/test_decode_padding.py`). The pages a full set of padding slots holds during a
step are kept out of what the runner reports as free, so the engine cannot plan them away.

A library may also carry one static-row batch decode per bucket (`batch_decode_b8`, listed in
`target.details.static_decode_functions`; CUDA libraries have them): a padded step calls its
bucket's function, whose quantized matmuls read each weight byte once for all rows
(`QuantDecodeGEMV`), instead of the symbolic `batch_decode`, which stays the fallback for a
bucket without one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

# Scratch sequence ids: far above the engine's ids (it counts up from 0), within int64.
SCRATCH_SEQ_BASE = 1 << 48
# The token a padding row feeds (any valid id: its logits are dropped).
PADDING_TOKEN = 0


class DecodePadding:
    """Rounds decode steps up to `buckets` rows with scratch sequences of a paged KV cache.

    `add_sequence(seq_id)` and `popn(seq_id, n)` are the KV cache's own operations (the runner
    passes its methods)."""

    def __init__(
        self,
        buckets: list[int] | tuple[int, ...],
        add_sequence: Callable[[int], None],
        popn: Callable[[int, int], None],
        functions: dict[int, str] | None = None,
    ):
        """`functions`: bucket -> the library's static-row decode function for that size."""
        sizes = sorted({int(b) for b in buckets})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"decode batch buckets must be positive sizes, got {list(buckets)}")
        self.buckets = tuple(sizes)
        self.functions = {int(k): v for k, v in (functions or {}).items() if int(k) in sizes}
        self._add_sequence = add_sequence
        self._popn = popn
        self.scratch: list[int] = []  # scratch sequence ids added to the cache so far

    def slots_for(self, max_rows: int) -> int:
        """Most padding rows a step of at most `max_rows` real rows needs (31 for 64 with the
        CUDA buckets: 33 rows run as 64): the scratch sequences' slots and pages to reserve."""
        return max((self.bucket(n) - n for n in range(1, max_rows + 1)), default=0)

    def function(self, padded_rows: int) -> str:
        """The function a padded step of `padded_rows` runs: the bucket's static-row one where
        the library has it, else the symbolic `batch_decode`."""
        return self.functions.get(padded_rows, "batch_decode")

    def bucket(self, rows: int) -> int:
        """The batch size `rows` is run at: the smallest bucket that holds it (itself when it
        is above the largest; the runner caps its batch to the largest)."""
        i = bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else rows

    def pad(self, items: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
        """`items` (one token each) followed by padding rows up to the bucket."""
        extra = self.bucket(len(items)) - len(items)
        while len(self.scratch) < extra:
            seq_id = SCRATCH_SEQ_BASE + len(self.scratch)
            self._add_sequence(seq_id)
            self.scratch.append(seq_id)
        return items + [(seq_id, [PADDING_TOKEN]) for seq_id in self.scratch[:extra]]

    def rewind(self, padded_rows: int) -> None:
        """Take back the token each of the first `padded_rows` scratch sequences got. Called
        once the step's `begin_forward` has succeeded (it appends to every sequence), also
        when the forward itself then fails, so scratch sequences stay empty between steps."""
        for seq_id in self.scratch[:padded_rows]:
            self._popn(seq_id, 1)


def decode_padding_for(
    details: dict,
    bound_details: dict,
    buckets: tuple[int, ...] | None,
    add_sequence: Callable[[int], None],
    popn: Callable[[int, int], None],
) -> DecodePadding | None:
    """The runner's padding: `buckets` if given, else those its device's bound records
    (`bound_details`, the CUDA graph's), else none; with the library's static-row decode
    functions (`details`: the library's `target.details`)."""
    buckets = buckets or bound_details.get("batch_buckets")
    if not buckets:
        return None
    static = details.get("static_decode_functions") or {}
    return DecodePadding(buckets, add_sequence, popn, {int(r): f for r, f in static.items()})
