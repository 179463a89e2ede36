"""Runs a compiled artifact: weights on the device, the paged KV cache, prefill and decode.

Implements the engine's `ModelRunner` protocol over TVM's paged KV cache builtins.
Only `tvm.runtime` is used, so this works with `TVM_USE_RUNTIME_LIB=1`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .artifact import (
    TokenizerBundle,
    check_artifact_files,
    load_tokenizer,
    read_weights,
)
from .cpu_threads import configure_cpu_threads
from .decode_padding import decode_padding_for
from .devices import device_kind, open_device
from .errors import ArtifactError
from .host_weights import host_weights
from .library_link import library_path as _library_path  # noqa: F401 (tests, benchmarks)
from .library_select import LibraryChoice, choose_library
from .manifest import Manifest
from .model_runner_protocol import SAMPLER_FUNCTION, SamplingControls

# The hidden-state function (compiler/model_defs/decoder.py), and what generation needs.
HIDDEN_FUNCTION = "batch_prefill_hidden"
_GENERATION_FUNCTIONS = ("decode", "batch_prefill", "batch_decode")

log = logging.getLogger(__name__)


@dataclass
class KVCacheConfig:
    """How big the paged KV cache is; the engine derives these from its memory budget."""

    max_batch_size: int = 32
    max_total_tokens: int = 0  # 0: one full context window per max_batch_size/4 sequences
    prefill_chunk_size: int = 512


def _load_tvm():
    try:
        import tvm  # noqa: F401  (runtime-only when TVM_USE_RUNTIME_LIB=1)
        from tvm.runtime import vm as tvm_vm
    except ImportError as e:  # pragma: no cover - install problem
        raise ArtifactError(f"the TVM runtime is not installed ({e})") from e
    return tvm, tvm_vm


class DeviceLogits:
    """Logits a forward left on a GPU: copied to the host once, on first read.

    The engine samples most rows with the compiled sampler and never reads these; rows with
    penalties, biases or logprobs index it (`np.asarray(logits)[rows]`).
    """

    def __init__(self, tensor, rows: int, vocab_size: int) -> None:
        self._tensor = tensor
        self.shape = (rows, vocab_size)
        self._host: np.ndarray | None = None

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if self._host is None:
            self._host = self._tensor.numpy().reshape(self.shape)
        if dtype is None or np.dtype(dtype) == self._host.dtype:
            return self._host
        return self._host.astype(dtype)

    def __getitem__(self, index):
        return np.asarray(self)[index]


class TVMModelRunner:
    """One loaded model and its KV cache (see `model_runner_protocol.ModelRunner`: the KV
    lifecycle half is called by the engine's `KVCacheManager` only)."""

    def __init__(
        self,
        folder: str | Path,
        device: str | LibraryChoice | None = None,
        kv: KVCacheConfig | None = None,
        threads: int | None = None,
        decode_buckets: tuple[int, ...] | None = None,
    ):
        """`decode_buckets`: batch sizes `batch_decode` steps are rounded up to; by default
        the CUDA-graph buckets the manifest records (none on other devices)."""
        self.folder = Path(folder)
        self.manifest = Manifest.read(self.folder)
        # `device`: auto (None), cpu, cuda[:N], metal[:N], or a choice already made.
        if isinstance(device, LibraryChoice):
            choice = device
        else:
            choice = choose_library(self.manifest, device)
        log.info("library %s (%s)", choice.path, choice.why)
        self.library = library = choice.library
        check_artifact_files(self.folder, self.manifest, library)
        self.device_kind = device_kind(choice.device)
        if self.device_kind.sets_cpu_threads:
            configure_cpu_threads(threads)  # before the first kernel runs
        degree = self.manifest.tensor_parallel_degree
        if degree != self.workers:
            raise ArtifactError(
                f"{self.folder} was compiled for {degree} tensor-parallel worker(s), not "
                f"{self.workers}: run it with {degree} (docs/tensor-parallel.md)"
            )
        tvm, tvm_vm = _load_tvm()
        self._tvm = tvm
        self._load_model(tvm, tvm_vm, choice)
        self.tokenizer: TokenizerBundle = load_tokenizer(self.folder, self.manifest)

        cfg = self.manifest.model.config
        self.hidden_size = int(cfg["hidden_size"])
        self.vocab_size = int(cfg["vocab_size"])
        self.context_window = int(self.manifest.kv_cache.context_window)
        self.page_size = int(self.manifest.kv_cache.page_size)
        kv = kv or KVCacheConfig()
        # CUDA artifacts plan batch_decode's memory for a bounded batch (CUDA graphs).
        bound, details = None, {}
        if self.device_kind.batch_bound_detail is not None:
            details = (library.details or {}).get(self.device_kind.batch_bound_detail) or {}
            bound = details.get("max_batch_size")
        if bound and kv.max_batch_size > int(bound):
            log.info("max batch %d capped to the compiled bound %d", kv.max_batch_size, bound)
            kv = dataclasses.replace(kv, max_batch_size=int(bound))
        self.max_batch_size = kv.max_batch_size
        self.prefill_chunk_size = kv.prefill_chunk_size
        total = kv.max_total_tokens or self.context_window * max(1, kv.max_batch_size // 4)
        total = max(total, self.page_size)
        # batch_decode steps rounded up to the CUDA-graph buckets (decode_padding.py): each
        # padding slot's scratch sequence takes a sequence slot and, during a step, one page,
        # both on top of what was asked for.
        self.decode_padding = padding = decode_padding_for(
            library.details or {}, details, decode_buckets, self.add_sequence, self.popn
        )
        self._padding_slots = padding.slots_for(kv.max_batch_size) if padding else 0
        total += self._padding_slots * self.page_size
        functions = set(self.manifest.functions)
        names = ["embed", "create_paged_kv_cache"]
        # `tallow compile --task embed` artifacts carry the embedding path only.
        self.supports_generation = all(f in functions for f in _GENERATION_FUNCTIONS)
        if self.supports_generation:
            names += _GENERATION_FUNCTIONS
            names += padding.functions.values() if padding else []
        # Artifacts from before the compiled sampler sample on the host.
        self.supports_device_sampling = SAMPLER_FUNCTION in functions
        if self.supports_device_sampling:
            names.append(SAMPLER_FUNCTION)
        # Artifacts from before embeddings have no hidden-state function.
        embedding = self.manifest.embedding
        self.embedding_pooling = None
        if embedding is not None and embedding.function in functions:
            self.embedding_pooling = embedding.pooling
            names.append(embedding.function)
        self._hidden_function = embedding.function if embedding is not None else HIDDEN_FUNCTION
        self._funcs = {name: self.vm[name] for name in names}
        self._last_logits = None  # (tensor, rows) of the last forward, for `sample`
        # `--deterministic`: each token through the same function at every batch size
        # (`forward`); set by the engine factory.
        self.batch_invariant = False
        # prefill's matmul kernels switch path by a call's row count (AMX from this many
        # rows: `prefill_bf16_amx_from_rows`): batch-invariant runs give each chunk a call
        self.prefill_rows_switch = (library.details or {}).get("prefill_bf16_amx_from_rows")
        self._controls = None  # device buffer for `sample`'s per-row controls
        get = self._global_func
        self._add_seq = get("vm.builtin.kv_state_add_sequence")
        self._fork_seq = get("vm.builtin.kv_state_fork_sequence")
        self._remove_seq = get("vm.builtin.kv_state_remove_sequence")
        self._popn = get("vm.builtin.kv_state_popn")
        self._begin = get("vm.builtin.kv_state_begin_forward")
        self._end = get("vm.builtin.kv_state_end_forward")
        self._free_pages = get("vm.builtin.attention_kv_cache_get_num_available_pages")
        shape = tvm.runtime.ShapeTuple
        # support_sliding_window=0 even for windowed models (manifest kv_cache.sliding_window):
        # the cache's per-sequence window mode evicts old pages of every layer, and global
        # layers still read them. Windows are per layer, applied by the attention kernels.
        self.sliding_window = self.manifest.kv_cache.sliding_window
        self.kv_cache = self._funcs["create_paged_kv_cache"](
            shape([kv.max_batch_size + self._padding_slots]),
            shape([total]),
            shape([kv.prefill_chunk_size]),
            shape([self.page_size]),
            shape([0]),
        )
        self.num_pages = self.num_free_pages()
        kv_info = self.manifest.kv_cache
        log.info(
            "KV cache: %d pages of %d tokens (%d tokens, %s, %d bytes a page), max batch %d",
            self.num_pages,
            self.page_size,
            self.num_pages * self.page_size,
            kv_info.dtype,
            kv_info.bytes_per_page(),
            kv.max_batch_size,
        )

    workers = 1  # tensor-parallel workers this runner drives (tp_runner.py: several)

    def _load_model(self, tvm, tvm_vm, choice: LibraryChoice) -> None:
        """Open the device, load the library into a VM and the weights onto the device."""
        library = choice.library
        self.device = open_device(tvm, self.device_kind, choice.index, library.target)
        try:
            # tvm_ffi's loader, not tvm.runtime.load_module: that one resolves symlinks and
            # takes the format from the target's suffix, which a hub cache's blob lacks.
            import tvm_ffi

            lib = tvm_ffi.load_module(str(_library_path(self.folder, library)))
        except Exception as e:  # TVM raises its own error types
            raise ArtifactError(f"cannot load {library.file}: {e}") from e
        self.vm = tvm_vm.VirtualMachine(lib, self.device)
        weights = read_weights(self.folder, self.manifest, library)
        if self.device_kind.huge_page_weights:
            self.params = host_weights(tvm, weights, self.device)
        else:
            self.params = [tvm.runtime.tensor(a, self.device) for a in weights]

    # --- the ModelRunner protocol -------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        self._add_seq(self.kv_cache, seq_id)

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int) -> None:
        self._fork_seq(self.kv_cache, parent_id, child_id, fork_pos)

    def remove_sequence(self, seq_id: int) -> None:
        self._remove_seq(self.kv_cache, seq_id)

    def popn(self, seq_id: int, n: int) -> None:
        self._popn(self.kv_cache, seq_id, n)

    def _global_func(self, name: str):
        return self._tvm.get_global_func(name)

    def num_free_pages(self) -> int:
        return int(self._free_pages(self.kv_cache)) - self._padding_slots

    def forward(self, items: list[tuple[int, list[int]]], num_logits=None):
        """Append each item's tokens to its sequence; float32 logits of each item's last
        `num_logits[i]` tokens (default 1), item after item: a host array on the CPU, a
        `DeviceLogits` (copied when read) elsewhere."""
        if not items:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        if not self.supports_generation:
            raise RuntimeError(f"{self.folder} is an embedding-only artifact: no logits")
        lengths = [len(toks) for _, toks in items]
        if min(lengths) < 1:
            raise ValueError("every forward item needs at least one token")
        counts = [1] * len(items) if num_logits is None else list(num_logits)
        if not all(1 <= c <= n for c, n in zip(counts, lengths, strict=True)):
            raise ValueError("num_logits: between 1 and the item's token count")
        rows = sum(counts)
        if rows > len(items) and counts == lengths and self.device_kind.verifies_in_decode:
            logits = self._run_tokens_as_rows(items)
        elif rows > len(items) and self.batch_invariant and self._mixes_paths(lengths):
            logits = self._run_each(items, counts)
        elif rows > len(items):
            ends = np.cumsum(lengths)
            positions = [np.arange(e - c, e) for e, c in zip(ends, counts, strict=True)]
            logits = self._run(items, np.concatenate(positions).astype(np.int32))
        elif self.batch_invariant and self._mixes_paths(lengths):
            logits = self._run_apart(items)
        else:
            logits = self._run(items, np.cumsum(lengths, dtype=np.int32) - 1)
        self._last_logits = (logits, rows)
        if self.device_kind.shares_host_memory:
            # The logits already are host memory: a view (it keeps the tensor alive) instead
            # of a copy, which took about 1 ms of a 16-sequence decode step (3 MB, cold).
            return np.from_dlpack(logits).reshape(rows, self.vocab_size)
        return DeviceLogits(logits, rows, self.vocab_size)

    def _run_tokens_as_rows(self, items: list[tuple[int, list[int]]]):
        """`batch_decode` over every token of the items, one row each: speculative
        verification (`DeviceKind.verifies_in_decode`). The cache attends each token to its
        sequence's earlier ones and those before it in the item, as in a prefill."""
        tvm = self._tvm
        ids = np.fromiter((t for _, toks in items for t in toks), dtype=np.int32)
        embeds = self._funcs["embed"](tvm.runtime.tensor(ids, self.device), self.params)
        embeds = embeds._create_view((int(ids.size), 1, self.hidden_size))
        seq_ids = tvm.runtime.ShapeTuple([s for s, _ in items])
        self._begin(self.kv_cache, seq_ids, tvm.runtime.ShapeTuple([len(t) for _, t in items]))
        try:
            logits, _ = self._funcs["batch_decode"](embeds, self.kv_cache, self.params)
        finally:
            self._end(self.kv_cache)
        return logits

    def forward_prompt_logits(self, items: list[tuple[int, list[int]]]) -> list[np.ndarray]:
        """Append each item's tokens to its sequence; float32 logits after every fed token,
        [len(tokens), vocab] per item on the host (`batch_prefill` at every position)."""
        if not items:
            return []
        if not self.supports_generation:
            raise RuntimeError(f"{self.folder} is an embedding-only artifact: no logits")
        lengths = [len(toks) for _, toks in items]
        if min(lengths) < 1:
            raise ValueError("every forward item needs at least one token")
        total = int(sum(lengths))
        if self.batch_invariant and self._mixes_paths(lengths):
            rows = self._run_each(items, lengths).numpy()
        else:
            logits = self._run(items, np.arange(total, dtype=np.int32))
            rows = logits.numpy().reshape(total, self.vocab_size)
        return np.split(rows, np.cumsum(lengths)[:-1])

    def forward_hidden(self, items: list[tuple[int, list[int]]]) -> list[np.ndarray]:
        """Append each item's tokens to its sequence; float32 final hidden states per item
        ([len(tokens), hidden] each), through the same paged KV cache as a prefill."""
        if not items:
            return []
        if self.embedding_pooling is None:
            raise RuntimeError(f"{self.folder} has no hidden-state function ({HIDDEN_FUNCTION})")
        tvm = self._tvm
        lengths = [len(toks) for _, toks in items]
        if min(lengths) < 1:
            raise ValueError("every forward item needs at least one token")
        ids = np.fromiter((t for _, toks in items for t in toks), dtype=np.int32)
        embeds = self._funcs["embed"](tvm.runtime.tensor(ids, self.device), self.params)
        embeds = embeds._create_view((1, int(ids.size), self.hidden_size))
        seq_ids = tvm.runtime.ShapeTuple([s for s, _ in items])
        self._begin(self.kv_cache, seq_ids, tvm.runtime.ShapeTuple(lengths))
        try:
            hidden, _ = self._funcs[self._hidden_function](embeds, self.kv_cache, self.params)
        finally:
            self._end(self.kv_cache)
        rows = hidden.numpy().reshape(int(ids.size), self.hidden_size)
        return np.split(rows, np.cumsum(lengths)[:-1])

    def sample(self, controls: SamplingControls) -> np.ndarray:
        """Token ids drawn by the artifact's `sample_tokens` from the last forward's logits."""
        if not self.supports_device_sampling or self._last_logits is None:
            raise RuntimeError("sample() needs an artifact with sample_tokens and a forward")
        tensor, rows = self._last_logits
        packed = controls.packed()
        view = tensor._create_view((rows, self.vocab_size))
        sample_tokens = self._funcs[SAMPLER_FUNCTION]
        if self.device_kind.shares_host_memory:
            # numpy arrays pass through DLPack: no device tensors to create or copy into
            return np.from_dlpack(sample_tokens(view, packed))
        # One reused device buffer, one copy (a fresh tensor per input cost 25 us each).
        if self._controls is None or self._controls.shape[0] < rows:
            shape = (max(rows, 64), packed.shape[1])
            self._controls = self._tvm.runtime.empty(shape, "float32", self.device)
        args = self._controls._create_view(packed.shape)
        args.copyfrom(packed)
        return sample_tokens(view, args).numpy()

    def _run(self, items: list[tuple[int, list[int]]], positions: np.ndarray):
        """One forward over the KV cache; the logits tensor at `positions` of the packed tokens.

        Single tokens at their own positions go through `decode` (one) or `batch_decode`."""
        tvm = self._tvm
        rows = len(items)
        decode = max(len(toks) for _, toks in items) == 1 and len(positions) == rows
        # One sequence: `decode` where the device kind says it pays (devices.py).
        single = decode and rows == 1 and self.device_kind.single_sequence_decode
        single = single and not self.batch_invariant
        if decode and not single and self.decode_padding is not None:
            items = self.decode_padding.pad(items)
        lengths = [len(toks) for _, toks in items]
        ids = np.fromiter((t for _, toks in items for t in toks), dtype=np.int32)
        embeds = self._funcs["embed"](tvm.runtime.tensor(ids, self.device), self.params)
        seq_ids = tvm.runtime.ShapeTuple([s for s, _ in items])
        self._begin(self.kv_cache, seq_ids, tvm.runtime.ShapeTuple(lengths))
        try:
            if decode:
                name = "decode" if single else "batch_decode"
                # The bucket's static-row decode, except under `--deterministic`: a row's
                # numbers must not depend on the bucket its step falls in.
                padding = None if single or self.batch_invariant else self.decode_padding
                name = padding.function(len(items)) if padding else name
                embeds = embeds._create_view((len(items), 1, self.hidden_size))
                logits, _ = self._funcs[name](embeds, self.kv_cache, self.params)
            else:
                embeds = embeds._create_view((1, int(ids.size), self.hidden_size))
                logits, _ = self._funcs["batch_prefill"](
                    embeds, tvm.runtime.tensor(positions, self.device), self.kv_cache, self.params
                )
        finally:
            self._end(self.kv_cache)
            if len(items) > rows:  # the padding rows' tokens are taken back, their logits dropped
                self.decode_padding.rewind(len(items) - rows)
        if len(items) > rows:
            logits = logits._create_view((rows, 1, self.vocab_size))
        return logits

    def _mixes_paths(self, lengths: list[int]) -> bool:
        """Whether one forward of items of these token counts could give a token another
        path than its item alone would (`_run_apart`)."""
        chunks = sum(n > 1 for n in lengths)
        return (1 in lengths and chunks > 0) or (bool(self.prefill_rows_switch) and chunks > 1)

    def _run_each(self, items: list[tuple[int, list[int]]], counts: list[int]):
        """Each item a forward of its own, the logits of its last `counts[i]` tokens (prompt
        log-probabilities under `batch_invariant`: see `_run_apart`)."""
        parts = []
        for item, c in zip(items, counts, strict=True):
            n = len(item[1])
            logits = self._run([item], np.arange(n - c, n, dtype=np.int32))
            parts.append(logits.numpy().reshape(c, self.vocab_size))
        return self._tvm.runtime.tensor(np.concatenate(parts), self.device)

    def _run_apart(self, items: list[tuple[int, list[int]]]):
        """A batch mixing single tokens and longer chunks, as two forwards: the single tokens
        through `batch_decode`, the chunks through `batch_prefill`; the logits in item order.

        In one forward the single tokens would take the prefill kernels (float activations,
        the prefill attention) whenever a chunk shares their step, and the decode kernels
        otherwise: their numbers would depend on what else is running (docs/cpu-kernels.md).
        When prefill's matmuls pick their path by a call's row count (AMX for 32 rows or
        more, `prefill_rows_switch`), each chunk is a forward of its own: its path is then
        its own row count, which the deterministic chunk grid fixes.
        """
        singles = [i for i, (_, toks) in enumerate(items) if len(toks) == 1]
        chunks = [i for i, (_, toks) in enumerate(items) if len(toks) > 1]
        out = np.empty((len(items), self.vocab_size), dtype=np.float32)
        parts = [[i] for i in chunks] if self.prefill_rows_switch else [chunks]
        for part in [*parts, singles]:
            if not part:
                continue
            sub = [items[i] for i in part]
            ends = np.cumsum([len(t) for _, t in sub], dtype=np.int32) - 1
            out[part] = self._run(sub, ends).numpy().reshape(len(part), self.vocab_size)
        return self._tvm.runtime.tensor(out, self.device)


def all_position_logits(
    runner: TVMModelRunner, tokens: list[int], seq_id: int = 0, start: int = 0
) -> np.ndarray:
    """Float32 logits after every token of `tokens[start:]` (for perplexity), chunk by chunk.

    The tokens before `start` are context only: they run through the model, but no logits are
    computed for them (`tallow eval` scores the second half of each window)."""
    runner.add_sequence(seq_id)
    out = []
    try:
        for begin in range(0, len(tokens), runner.prefill_chunk_size):
            chunk = tokens[begin : begin + runner.prefill_chunk_size]
            first = min(max(0, start - begin), len(chunk) - 1)  # the kernels need one position
            positions = np.arange(first, len(chunk), dtype=np.int32)
            logits = runner._run([(seq_id, chunk)], positions)
            if begin + len(chunk) > start:
                out.append(logits.numpy().reshape(len(positions), runner.vocab_size))
    finally:
        runner.remove_sequence(seq_id)
    if not out:
        return np.zeros((0, runner.vocab_size), dtype=np.float32)
    return np.concatenate(out, axis=0)
