"""tallow's Disco worker process: `python -m tallow.runtime.tp_worker <id> <n> <groups> <r> <w>`.

A `ProcessSession(n, entrypoint="tallow.runtime.tp_worker")` starts one of these per worker
(one GPU each for `--device cuda`). Compared with TVM's own entrypoint
(`tvm.exec.disco_worker`) it:

1. makes Disco importable the way the controller does (`disco_runtime`: preload the runtime
   libraries before `import tvm`), and loads tallow's NCCL module when it is built, so that
   `init_ccl("nccl", ...)` finds `runtime.disco.nccl.init_ccl_per_worker` in this process;
2. registers `tallow.tp.load_shard`, with which each worker reads its own slices of the
   artifact's weights from disk (the weight files are memory-mapped, so a worker touches only
   its slices' pages) instead of the controller reading every weight and shipping each slice
   through the pipe;
3. then runs TVM's worker loop (`runtime.disco.WorkerProcess`) until the session shuts down.

Worker 0 of a TVM ProcessSession is not a process: it is a thread of the controller
(`process_session.cc` keeps a `DiscoWorkerThread` for it), so the controller registers
`load_shard` too (`register()`, called by `tp_runner.start_workers`) and loads the NCCL module
(`disco_runtime.disco(ccl="nccl")`); worker 0 then runs on cuda:0 inside the controller.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

LOAD_SHARD = "tallow.tp.load_shard"


def load_shard(folder: str, library_file: str):
    """This worker's parameters (its slice of each split weight, the rest whole), in the order
    the library takes them, on the worker's default device (cuda:i once NCCL is initialised,
    else the CPU)."""
    import tvm

    from .artifact import read_weights
    from .errors import ArtifactError
    from .manifest import Manifest
    from .tp_runner import shard

    get = tvm.get_global_func
    rank = int(get("runtime.disco.worker_id")()[0])
    world = int(get("runtime.disco.world_size")())
    device = get("runtime.disco.device")()
    manifest = Manifest.read(Path(folder))
    degree = manifest.tensor_parallel_degree
    if degree != world:
        raise ArtifactError(f"{folder} is split {degree} ways, the session has {world} workers")
    library = next((lib for lib in manifest.libraries if lib.file == library_file), None)
    if library is None:
        raise ArtifactError(f"{folder} has no library {library_file}")
    rules = manifest.tensor_parallel.shards
    out = []
    infos = manifest.params_for(library)
    for info, array in zip(infos, read_weights(Path(folder), manifest, library), strict=True):
        rule = rules.get(info.name)
        part = shard(array, rule, world, rank) if rule else array
        out.append(tvm.runtime.tensor(part, device))
    return out


def register() -> None:
    """Install `load_shard` under `LOAD_SHARD` in this process (idempotent)."""
    import tvm_ffi

    tvm_ffi.register_global_func(LOAD_SHARD, load_shard, override=True)


def main(argv: list[str]) -> None:
    from . import nccl_module
    from .disco_runtime import disco

    disco()
    try:
        if nccl_module.built() is not None:
            nccl_module.load()
    except nccl_module.NcclModuleError as e:  # the controller refuses NCCL in one line itself
        log.warning("%s", e)
    register()
    import tvm_ffi

    worker_id, workers, groups, reader, writer = (int(a) for a in argv)
    tvm_ffi.get_global_func("runtime.disco.WorkerProcess")(
        worker_id, workers, groups, reader, writer
    )


if __name__ == "__main__":
    if len(sys.argv) != 6:
        sys.exit("usage: python -m tallow.runtime.tp_worker <id> <workers> <groups> <r> <w>")
    # OSError: the controller closed the pipes, nothing to report
    with contextlib.suppress(OSError, KeyboardInterrupt):
        main(sys.argv[1:])
