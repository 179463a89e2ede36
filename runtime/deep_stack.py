"""Worker threads with a deep stack, for native code that recurses as deep as its input nests.

llguidance compiles a grammar recursively, and a grammar nested deeply enough overflows the
stack of the thread compiling it: in native code that is a segfault of the whole process,
every stream in flight with it (issue 33: about 3,000 chained Lark rules, or 3,000 chained
JSON-schema `$ref`s, on the 8 MiB stack a Linux thread gets by default, the main thread's
too). Grammars therefore compile on these threads, whose stack is 256 MiB: address space
only, committed page by page as the recursion reaches it, so an ordinary grammar costs what
it costs anywhere. The server's grammar limits (`grammar_limits.py`) keep what reaches
llguidance far below where even an 8 MiB stack fails; this stack is the margin on top
(`benchmarks/grammar_limits.py` measures both).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["DEEP_STACK_BYTES", "DeepStackExecutor", "run_on_deep_stack"]

T = TypeVar("T")

DEEP_STACK_BYTES = 256 * 2**20

# `threading.stack_size` is process-wide: set it only while this module starts a thread. A
# thread another module starts in that window gets a deep stack too, which is harmless.
_stack_size_lock = threading.Lock()


class DeepStackExecutor(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose threads have a `stack_bytes` stack."""

    def __init__(self, max_workers: int, thread_name_prefix: str, stack_bytes: int) -> None:
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self._stack_bytes = stack_bytes

    def _adjust_thread_count(self) -> None:
        # The pool starts its threads here, lazily, from `submit`.
        with _stack_size_lock:
            previous = threading.stack_size(self._stack_bytes)
            try:
                super()._adjust_thread_count()
            finally:
                threading.stack_size(previous)


_pool: DeepStackExecutor | None = None
_pool_lock = threading.Lock()


def run_on_deep_stack(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """`fn(*args, **kwargs)` on a deep-stack thread; waits for it and returns its result (or
    raises its exception). Two threads: a slow compile does not hold up every other one."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = DeepStackExecutor(2, "tallow-deep-stack", DEEP_STACK_BYTES)
    return _pool.submit(fn, *args, **kwargs).result()
