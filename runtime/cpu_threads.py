"""How many threads TVM's CPU thread pool runs kernels on.

TVM sizes its pool once, when a thread first launches a parallel kernel, from
`TVM_NUM_THREADS` (else `OMP_NUM_THREADS`, else half the hardware threads on x86, on the
assumption that every core has two hyper-threads). On a machine without SMT that halves the
speed: measured on a 2-core box, SmolLM2 decode ran on one thread, 58 ms per token instead
of 33. So the runner settles the count before its first kernel runs.

The default is every usable CPU but one. TVM's pool pins a worker to each core and ends
every parallel kernel at a barrier that the launching thread waits at by spinning
(sched_yield), as idle workers do for up to 300,000 yields (`TVM_THREAD_POOL_SPIN_COUNT`):
when another process takes a core, each of the few hundred kernels of a decode step waits
for the pinned worker's next time slice. Measured with `benchmarks/thread_contention.py`
(SmolLM2 Q4_1, 64 greedy tokens, AMD EPYC Zen 3, 2 cores, median of 4 interleaved rounds,
decode tok/s, quiet / with 2 busy processes): 1 thread 97.7 / 56.5; 2 threads 125.8 / 1.8;
2 threads without spinning 82.2 / 21.7; spin 1,000 115.0 / 4.1; spin 10,000 138.1 / 4.5.
Every 2-thread setting collapses or falls below one thread once the cores are shared; one
core left free keeps the pool's cores to itself as long as one other process runs (and
leaves the server's own threads, event loop and engine step, a core). On a machine of one's
own, `--threads` (or `TVM_NUM_THREADS`) set to every core takes the last 1.3x.
"""

from __future__ import annotations

import logging
import os

from .errors import TallowError

log = logging.getLogger(__name__)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        return os.cpu_count() or 1


def default_threads() -> int:
    """Every usable CPU but one, at least one (see the module docstring)."""
    return max(1, usable_cpus() - 1)


def configure_cpu_threads(threads: int | None = None) -> None:
    """Set the pool size for kernels launched from now on.

    `threads` None keeps a user's TVM_NUM_THREADS / OMP_NUM_THREADS and otherwise uses
    `default_threads()`. A thread whose pool already exists keeps its size (TVM cannot
    resize it).
    """
    if threads is not None:
        if threads < 1:
            raise TallowError(f"--threads must be at least 1 (got {threads})")
        os.environ["TVM_NUM_THREADS"] = str(threads)
    elif "TVM_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        os.environ["TVM_NUM_THREADS"] = str(default_threads())
    log.info("CPU kernel threads: %s", os.environ.get("TVM_NUM_THREADS", "OMP_NUM_THREADS"))
