"""Runs a compiled artifact: weights on the device, the paged KV cache, prefill and decode.

Implements the engine's `ModelRunner` protocol over TVM's paged KV cache builtins.
Only `tvm.runtime` is used, so this works with `TVM_USE_RUNTIME_LIB=1`.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .artifact import (
    TokenizerBundle,
    check_artifact_files,
    load_tokenizer,
    parse_device,
    read_weights,
)
from .errors import ArtifactError
from .manifest import Manifest

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


def _device(tvm, kind: str, index: int, manifest: Manifest):
    if kind == "cpu":
        return tvm.cpu(index)
    if kind == "cuda":
        # In runtime-only mode the CUDA device API lives in a separate library.
        lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
        if os.environ.get("TVM_USE_RUNTIME_LIB") and lib.is_file():
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                raise ArtifactError(f"cannot load the CUDA runtime ({e})") from e
        dev = tvm.cuda(index)
    else:
        dev = tvm.metal(index)
    if not dev.exist:
        arch = manifest.target.details.get("arch", "")
        built = f"{kind} {arch}".strip()
        raise ArtifactError(f"artifact built for {built}; no {kind.upper()} device {index} found")
    return dev


class TVMModelRunner:
    """One loaded model and its KV cache (see `model_runner_protocol.ModelRunner`)."""

    def __init__(
        self,
        folder: str | Path,
        device: str | None = None,
        kv: KVCacheConfig | None = None,
    ):
        self.folder = Path(folder)
        self.manifest = Manifest.read(self.folder)
        check_artifact_files(self.folder, self.manifest)
        kind, index = parse_device(device, self.manifest)
        tvm, tvm_vm = _load_tvm()
        self._tvm = tvm
        self.device = _device(tvm, kind, index, self.manifest)
        try:
            lib = tvm.runtime.load_module(str(self.folder / self.manifest.library))
        except Exception as e:  # TVM raises its own error types
            raise ArtifactError(f"cannot load {self.manifest.library}: {e}") from e
        self.vm = tvm_vm.VirtualMachine(lib, self.device)
        self.params = [
            tvm.runtime.tensor(a, self.device) for a in read_weights(self.folder, self.manifest)
        ]
        self.tokenizer: TokenizerBundle = load_tokenizer(self.folder, self.manifest)

        cfg = self.manifest.model.config
        self.hidden_size = int(cfg["hidden_size"])
        self.vocab_size = int(cfg["vocab_size"])
        self.context_window = int(self.manifest.kv_cache.context_window)
        self.page_size = int(self.manifest.kv_cache.page_size)
        kv = kv or KVCacheConfig()
        self.max_batch_size = kv.max_batch_size
        self.prefill_chunk_size = kv.prefill_chunk_size
        total = kv.max_total_tokens or self.context_window * max(1, kv.max_batch_size // 4)
        total = max(total, self.page_size)
        self._funcs = {
            name: self.vm[name]
            for name in ("embed", "batch_prefill", "batch_decode", "create_paged_kv_cache")
        }
        get = tvm.get_global_func
        self._add_seq = get("vm.builtin.kv_state_add_sequence")
        self._fork_seq = get("vm.builtin.kv_state_fork_sequence")
        self._remove_seq = get("vm.builtin.kv_state_remove_sequence")
        self._popn = get("vm.builtin.kv_state_popn")
        self._begin = get("vm.builtin.kv_state_begin_forward")
        self._end = get("vm.builtin.kv_state_end_forward")
        self._free_pages = get("vm.builtin.attention_kv_cache_get_num_available_pages")
        shape = tvm.runtime.ShapeTuple
        self.kv_cache = self._funcs["create_paged_kv_cache"](
            shape([kv.max_batch_size]),
            shape([total]),
            shape([kv.prefill_chunk_size]),
            shape([self.page_size]),
            shape([0]),
        )
        self.num_pages = int(self._free_pages(self.kv_cache))
        log.info(
            "KV cache: %d pages of %d tokens (%d tokens), max batch %d",
            self.num_pages,
            self.page_size,
            self.num_pages * self.page_size,
            kv.max_batch_size,
        )

    # --- the ModelRunner protocol -------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        self._add_seq(self.kv_cache, seq_id)

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int) -> None:
        self._fork_seq(self.kv_cache, parent_id, child_id, fork_pos)

    def remove_sequence(self, seq_id: int) -> None:
        self._remove_seq(self.kv_cache, seq_id)

    def popn(self, seq_id: int, n: int) -> None:
        self._popn(self.kv_cache, seq_id, n)

    def num_free_pages(self) -> int:
        return int(self._free_pages(self.kv_cache))

    def forward(self, items: list[tuple[int, list[int]]]) -> np.ndarray:
        """Append each item's tokens to its sequence; float32 logits of each last token."""
        if not items:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        tvm = self._tvm
        lengths = [len(toks) for _, toks in items]
        if min(lengths) < 1:
            raise ValueError("every forward item needs at least one token")
        ids = np.fromiter((t for _, toks in items for t in toks), dtype=np.int32)
        embeds = self._funcs["embed"](tvm.runtime.tensor(ids, self.device), self.params)
        seq_ids = tvm.runtime.ShapeTuple([s for s, _ in items])
        self._begin(self.kv_cache, seq_ids, tvm.runtime.ShapeTuple(lengths))
        try:
            if max(lengths) == 1:
                embeds = embeds._create_view((len(items), 1, self.hidden_size))
                logits, _ = self._funcs["batch_decode"](embeds, self.kv_cache, self.params)
            else:
                positions = np.cumsum(lengths, dtype=np.int32) - 1
                embeds = embeds._create_view((1, int(ids.size), self.hidden_size))
                logits, _ = self._funcs["batch_prefill"](
                    embeds, tvm.runtime.tensor(positions, self.device), self.kv_cache, self.params
                )
        finally:
            self._end(self.kv_cache)
        return logits.numpy().reshape(len(items), -1)[:, : self.vocab_size]

    # --- helpers ---------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)
