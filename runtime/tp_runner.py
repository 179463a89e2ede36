"""Runs a tensor-parallel artifact (`tallow compile --tensor-parallel N`) on N Disco workers.

What runs where: the controller (this thread) tokenizes, schedules and samples exactly as
for one worker; the engine above is unchanged. Each forward's token ids (and logit
positions) go to worker 0 and are broadcast to the others; every worker embeds them (the
embedding is replicated), runs its share of the layers (its heads, its MLP columns; the
library all-reduces after o_proj and down_proj) against its own paged KV cache, and
computes the full logits (the vocab head is replicated). Worker 0's logits come back to the
controller, which samples on the host (the compiled sampler is not run).

On a CPU the workers are threads (`ThreadedSession`) and the collectives are tallow's
Python ones (`cpu_collective.py`, a correctness aid, not fast). Weights: the artifact stores
them whole; each worker is given its slice (`shard`) at load, as the manifest's rules say.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from pathlib import Path

import numpy as np

from . import cpu_collective
from .artifact import read_weights
from .disco_runtime import disco
from .errors import ArtifactError, TallowError
from .library_link import library_path
from .library_select import LibraryChoice
from .manifest import Manifest
from .model_runner import TVMModelRunner

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
        if self.device_kind.name != "cpu":
            raise TallowError(
                f"tensor parallelism on {self.device_kind.name} needs a collective library "
                "(NCCL) the apache-tvm wheel lacks; only CPU worker threads run today"
            )
        cpu_collective.register()
        self.device = tvm.cpu(0)  # the controller's side of inputs and logits
        self.session = sess = self._disco.ThreadedSession(self.workers)
        # Worker threads still running when the interpreter exits abort it (std::terminate).
        atexit.register(_close_at_exit, weakref.ref(self))
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
        self._reshape = sess.get_global_func("vm.builtin.reshape")

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
