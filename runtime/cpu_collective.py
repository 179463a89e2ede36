"""Collectives among the worker threads of a Disco `ThreadedSession`, in Python.

A correctness and debugging aid, not a speed feature: every all-reduce copies each worker's
tensor to numpy, meets the others at a barrier and sums under the GIL. It lets a
tensor-parallel artifact run and be checked on a CPU, where the apache-tvm wheel has no
collective library at all (no NCCL, no CCL of any kind; docs/tensor-parallel.md).

How it plugs in: with no CCL initialised a Disco worker calls its collectives as the global
functions `runtime.disco.<ccl>.<name>` with an empty `<ccl>`, i.e.
`runtime.disco..allreduce`; `register()` installs the functions below under those names.
They only work where every worker is a thread of this process (a `ThreadedSession`): the
buffers meet in this module's memory. A collective nobody registered makes TVM call
`std::terminate`, which is why the tests run sessions in a subprocess.
"""

from __future__ import annotations

import threading

import numpy as np

PREFIX = "runtime.disco.."  # `runtime.disco.` + the (empty) CCL name + `.`
# TVM's ReduceKind, in its enum order (src/runtime/disco/builtin.h).
_REDUCE = {0: np.sum, 1: np.prod, 2: np.min, 3: np.max, 4: np.mean}


class _Rendezvous:
    """One meeting point per world size: each worker leaves its array in its slot, all wait,
    each reads what it needs, all wait again so no slot is overwritten while being read."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[np.ndarray | None] = [None] * world
        self.barrier = threading.Barrier(world)

    def exchange(self, rank: int, value: np.ndarray | None, read):
        self.slots[rank] = value
        self.barrier.wait()
        try:
            return read(self.slots)
        finally:
            self.barrier.wait()


_lock = threading.Lock()
_meetings: dict[int, _Rendezvous] = {}


def _here() -> tuple[int, _Rendezvous]:
    import tvm

    get = tvm.get_global_func
    rank = int(get("runtime.disco.worker_id")()[0])
    world = int(get("runtime.disco.world_size")())
    with _lock:
        meeting = _meetings.get(world)
        if meeting is None:
            meeting = _meetings[world] = _Rendezvous(world)
    return rank, meeting


def allreduce(send, kind: int, in_group: bool, recv) -> None:
    """recv = reduce(send of every worker); sum, prod, min, max or mean (`kind`)."""
    rank, meeting = _here()
    reduce = _REDUCE[int(kind)]
    out = meeting.exchange(rank, send.numpy(), lambda s: reduce(np.stack(s), axis=0))
    recv.copyfrom(np.ascontiguousarray(out, dtype=out.dtype))


def broadcast_from_worker0(send, in_group: bool, recv) -> None:
    """recv = worker 0's send, on every worker."""
    rank, meeting = _here()
    value = send.numpy() if rank == 0 else None
    recv.copyfrom(meeting.exchange(rank, value, lambda s: s[0]))


def allgather(send, in_group: bool, recv) -> None:
    """recv = every worker's send, concatenated along the first axis in worker order."""
    rank, meeting = _here()
    out = meeting.exchange(rank, send.numpy(), lambda s: np.concatenate(s, axis=0))
    recv.copyfrom(out.reshape(recv.shape))


_FUNCTIONS = {
    "allreduce": allreduce,
    "broadcast_from_worker0": broadcast_from_worker0,
    "allgather": allgather,
}


def register() -> None:
    """Install the collectives under the names a ThreadedSession's workers call (idempotent)."""
    import tvm_ffi

    for name, func in _FUNCTIONS.items():
        tvm_ffi.register_global_func(PREFIX + name, func, override=True)
