"""Runs a tensor-parallel artifact (`tallow compile --tensor-parallel N`) on N Disco workers.

What runs where: the controller (this thread) tokenizes, schedules and samples exactly as
for one worker; the engine above is unchanged. Each forward's token ids (and logit
positions) go to worker 0 and are broadcast to the others; every worker embeds them (the
embedding is replicated), runs its share of the layers (its heads, its MLP columns; the
library all-reduces after o_proj and down_proj) against its own paged KV cache, and
computes the full logits (the vocab head is replicated). Worker 0's logits come back to the
controller, which samples on the host (the compiled sampler is not run).

On a CPU the workers are threads (`ThreadedSession`) and the collectives are tallow's
Python ones (`cpu_collective.py`, a correctness aid, not fast); the controller slices the
weights (`shard`) and copies each worker its slices. With `--device cuda` the workers are
processes, one GPU each (`ProcessSession` with tallow's entrypoint, `tp_worker.py`), the
collective is tallow's NCCL module (`nccl_module.py`), and each worker reads its own slices
from the artifact's files. The CUDA path has never run: no GPU was available to write it on.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from pathlib import Path

import numpy as np

from . import cpu_collective, tp_worker
from .artifact import read_weights
from .disco_runtime import disco
from .errors import ArtifactError, TallowError
from .library_link import library_path
from .library_select import LibraryChoice
from .manifest import Manifest
from .model_runner import TVMModelRunner
from .tp_worker import LOAD_SHARD

log = logging.getLogger(__name__)


def shard(array: np.ndarray, rule: dict, degree: int, rank: int) -> np.ndarray:
    """Worker `rank`'s slice of a whole weight: each part of `rule["axis"]` cut in `degree`
    equal slices, slice `rank` of every part, concatenated."""
    axis, out, start = int(rule["axis"]), [], 0
    for size in rule["parts"]:
        step = int(size) // degree
        index = [slice(None)] * array.ndim
        index[axis] = slice(start + rank * step, start + (rank + 1) * step)
        out.append(array[tuple(index)])
        start += int(size)
    if start != array.shape[axis]:
        raise ArtifactError(f"shard rule {rule} does not cover axis {axis} of {array.shape}")
    return np.ascontiguousarray(np.concatenate(out, axis=axis))


class TPModelRunner(TVMModelRunner):
    """`TVMModelRunner` over a Disco session of `manifest.tensor_parallel.degree` workers."""

    def __init__(self, folder, device=None, kv=None, threads=None, workers: int | None = None):
        """`workers`: how many to start; the artifact's degree when None, refused otherwise."""
        manifest = Manifest.read(Path(folder))
        self.workers = manifest.tensor_parallel_degree if workers is None else int(workers)
        self._disco = disco()  # before anything imports tvm
        super().__init__(folder, device=device, kv=kv, threads=threads)
        # Sampling runs on the host from worker 0's logits (step_sampling's host path).
        self.supports_device_sampling = False

    def _load_model(self, tvm, tvm_vm, choice: LibraryChoice) -> None:
        start = _SESSIONS.get(self.device_kind.name)
        if start is None:
            raise TallowError(
                f"tensor parallelism runs on cpu (worker threads) or cuda (NCCL), "
                f"not {self.device_kind.name}"
            )
        self.device = tvm.cpu(0)  # the controller's side of inputs and logits
        self.session = start(self, tvm, choice)
        # Workers still running when the interpreter exits abort it (std::terminate).
        atexit.register(_close_at_exit, weakref.ref(self))
        self._reshape = self.session.get_global_func("vm.builtin.reshape")

    def _start_threads(self, tvm, choice: LibraryChoice):
        """CPU: worker threads of this process, tallow's Python collectives, and weights sliced
        here and copied to each worker."""
        cpu_collective.register()
        sess = self._disco.ThreadedSession(self.workers)
        library = choice.library
        self.vm = sess.load_vm_module(str(library_path(self.folder, library)), device=self.device)
        rules = self.manifest.tensor_parallel.shards
        infos = self.manifest.params_for(library)
        weights = read_weights(self.folder, self.manifest, library)
        drefs, n = [], self.workers
        for info, array in zip(infos, weights, strict=True):
            rule = rules.get(info.name)
            parts = [shard(array, rule, self.workers, r) if rule else array for r in range(n)]
            dref = sess.empty(parts[0].shape, str(parts[0].dtype))
            for rank, part in enumerate(parts):
                dref.debug_copy_from(rank, tvm.runtime.tensor(part))
            drefs.append(dref)
        self.params = sess.get_global_func("ffi.Array")(*drefs)
        return sess

    def _start_processes(self, tvm, choice: LibraryChoice):
        """CUDA: one worker process per GPU (`tp_worker.py`), NCCL between them, and each
        worker reading its own weight slices. Written against TVM 0.27's Disco and never run:
        no GPU was available (docs/tensor-parallel.md)."""
        self._disco = disco(ccl="nccl")  # the controller runs init_ccl: it needs the module
        sess = start_workers(self._disco, self.workers)
        try:
            sess.init_ccl("nccl", *range(self.workers))  # worker i on cuda:i
            library = choice.library
            path = str(library_path(self.folder, library))
            self.vm = sess.load_vm_module(path)  # on each worker's default device, cuda:i
            self.params = load_shards(sess, self.folder, library.file)
        except BaseException:
            sess.shutdown()  # live worker processes would outlast a failed load
            raise
        return sess

    def _global_func(self, name: str):
        return self.session.get_global_func(name)

    def num_free_pages(self) -> int:
        # every worker's cache holds the same pages (its own heads of each token)
        return int(self._free_pages(self.kv_cache).debug_get_from_remote(0)) - self._padding_slots

    def _call(self, items, name: str, rows_shape: tuple, positions: np.ndarray | None):
        """Broadcast the token ids, embed, run `name` on every worker; worker 0's first output."""
        tvm = self._tvm
        ids = np.fromiter((t for _, toks in items for t in toks), dtype=np.int32)
        embeds = self._funcs["embed"](self.session.broadcast(ids), self.params)
        embeds = self._reshape(embeds, tvm.runtime.ShapeTuple(rows_shape))
        seq_ids = tvm.runtime.ShapeTuple([s for s, _ in items])
        self._begin(self.kv_cache, seq_ids, tvm.runtime.ShapeTuple([len(t) for _, t in items]))
        try:
            if positions is None:
                out = self._funcs[name](embeds, self.kv_cache, self.params)
            else:
                pos = self.session.broadcast(positions.astype(np.int32))
                out = self._funcs[name](embeds, pos, self.kv_cache, self.params)
        finally:
            self._end(self.kv_cache)
        return out.debug_get_from_remote(0)[0]

    def _run(self, items, positions: np.ndarray):
        rows = len(items)
        decode = max(len(toks) for _, toks in items) == 1 and len(positions) == rows
        if decode:
            single = rows == 1 and self.device_kind.single_sequence_decode
            name = "decode" if single and not self.batch_invariant else "batch_decode"
            return self._call(items, name, (rows, 1, self.hidden_size), None)
        total = sum(len(toks) for _, toks in items)
        return self._call(items, "batch_prefill", (1, total, self.hidden_size), positions)

    def _run_tokens_as_rows(self, items):
        total = sum(len(toks) for _, toks in items)
        return self._call(items, "batch_decode", (total, 1, self.hidden_size), None)

    def forward_hidden(self, items):
        if not items:
            return []
        if self.embedding_pooling is None:
            raise RuntimeError(f"{self.folder} has no hidden-state function")
        lengths = [len(toks) for _, toks in items]
        total = int(sum(lengths))
        hidden = self._call(items, self._hidden_function, (1, total, self.hidden_size), None)
        rows = hidden.numpy().reshape(total, self.hidden_size)
        return np.split(rows, np.cumsum(lengths)[:-1])

    def close(self) -> None:
        """Free the workers' objects, then stop the workers (idempotent)."""
        session = self.__dict__.pop("session", None)
        if session is None:
            return
        for name in ("params", "kv_cache", "vm", "_funcs", "_reshape", "_last_logits"):
            self.__dict__.pop(name, None)
        for name in ("_add_seq", "_fork_seq", "_remove_seq", "_popn", "_begin", "_end"):
            self.__dict__.pop(name, None)
        self.__dict__.pop("_free_pages", None)
        session._sync_all()
        session.shutdown()


# The session each device kind runs its workers in.
_SESSIONS = {"cpu": TPModelRunner._start_threads, "cuda": TPModelRunner._start_processes}


def start_workers(disco_module, workers: int):
    """A ProcessSession whose workers run tallow's entrypoint (`tp_worker.py`); worker 0 is a
    thread of this process, so `load_shard` is registered here too."""
    tp_worker.register()
    return disco_module.ProcessSession(workers, entrypoint="tallow.runtime.tp_worker")


def load_shards(session, folder: Path, library_file: str):
    """Each worker of `session` loads its own slices of the artifact's weights
    (`tp_worker.load_shard`); a DRef to every worker's parameter array."""
    return session.get_global_func(LOAD_SHARD)(str(Path(folder).resolve()), library_file)


def _close_at_exit(ref: weakref.ref) -> None:
    runner = ref()
    if runner is not None:
        runner.close()


def runner_class(manifest: Manifest, workers: int | None = None) -> type[TVMModelRunner]:
    """The runner for the artifact's tensor-parallel degree; `workers` other than the degree
    is refused in one line (an artifact runs with the count it was compiled for only)."""
    degree = manifest.tensor_parallel_degree
    if workers is not None and workers != degree:
        raise TallowError(
            f"the artifact was compiled for {degree} tensor-parallel worker(s), not {workers}: "
            f"compile it again with --tensor-parallel {workers}"
        )
    return TVMModelRunner if degree == 1 else TPModelRunner
