"""Memory bandwidth a decode step could use, and the weight bytes it must read, for one file.

Batch-1 decode of a 3B-8B model reads every matmul weight once per token from memory (the
weights are 2-6 GB, the L3 32 MB), so tok/s x `weight_bytes_per_token` is the rate the
weights stream at, and `stream_gbps` (measured in the same run, on the same cores) is what a
plain read reaches there. Their ratio says how far decode is from the memory limit.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

STREAM_MIB = 1024  # 32x the Zen 3's L3: every pass reads from memory


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decode step reads: every tensor of the file in its stored type,
    except the token embedding, of which one row is read (all of it when the head is tied to
    it: the head then reads the whole table). KV cache reads are not counted."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    embd = tensors.get("token_embd.weight")
    if embd is not None and "output.weight" in tensors:  # untied: the table is only indexed
        rows = int(embd.shape[-1])  # GGUF lists dimensions innermost first: rows are last
        total -= int(embd.n_bytes) - int(embd.n_bytes) // rows
    return total


class Stream:
    """`threads` Python threads, each summing its slice of a `mib` MiB int64 array with
    numpy (which releases the GIL inside the reduction), timed together: the read rate of
    plain numpy on those cores. int64 add is the cheapest reduction numpy vectorizes (no
    pairwise summation), so it is the closest numpy gets to the memory's own limit."""

    def __init__(self, threads: int = 2, mib: int = STREAM_MIB) -> None:
        self.data = np.ones(mib << 17, np.int64)  # written once: the pages are resident
        self.parts = np.array_split(self.data, threads)

    def once(self) -> float:
        """GB/s of one pass over the whole array."""
        workers = [threading.Thread(target=np.add.reduce, args=(p,)) for p in self.parts]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return self.data.nbytes / (time.perf_counter() - t) / 1e9

    def best(self, passes: int = 5) -> float:
        return max(self.once() for _ in range(passes))
