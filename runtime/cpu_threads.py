"""How many threads TVM's CPU thread pool runs kernels on.

TVM sizes its pool once, when a thread first launches a parallel kernel, from
`TVM_NUM_THREADS` (else `OMP_NUM_THREADS`, else half the hardware threads on x86, on the
assumption that every core has two hyper-threads). On a machine without SMT that halves the
speed: measured on a 2-core box, SmolLM2 decode ran on one thread, 58 ms per token instead
of 33. So the runner settles the count before its first kernel runs.
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


def configure_cpu_threads(threads: int | None = None) -> None:
    """Set the pool size for kernels launched from now on.

    `threads` None keeps a user's TVM_NUM_THREADS / OMP_NUM_THREADS and otherwise uses every
    usable CPU. A thread whose pool already exists keeps its size (TVM cannot resize it).
    """
    if threads is not None:
        if threads < 1:
            raise TallowError(f"--threads must be at least 1 (got {threads})")
        os.environ["TVM_NUM_THREADS"] = str(threads)
    elif "TVM_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        os.environ["TVM_NUM_THREADS"] = str(usable_cpus())
    log.info("CPU kernel threads: %s", os.environ.get("TVM_NUM_THREADS", "OMP_NUM_THREADS"))
