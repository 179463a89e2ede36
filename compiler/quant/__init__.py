"""Vectorised numpy quantizers for llama.cpp's GGUF block formats.

``quantize(array, name)`` turns a float array whose last dimension is a multiple of the type's
block size into ``uint8[rows, row_bytes]`` laid out byte for byte as llama.cpp / GGUF store the
blocks; ``dequantize(blocks, name, shape)`` is the matching numpy decoder.

The legacy types (q4_0, q4_1, q5_0, q5_1, q8_0) reproduce ``gguf.quants.quantize`` bit for bit.
The K-quants (q2k..q6k) use a search for sub-block scales in the spirit of ggml's reference
quantizers (see :mod:`.kquants`); their blocks decode with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from . import kquants, legacy

__all__ = ["QUANT_TYPES", "QuantType", "quantize", "dequantize"]


@dataclass(frozen=True)
class QuantType:
    name: str
    ggml_type: GGMLQuantizationType
    block_size: int
    type_size: int
    bits_per_weight: float
    quantize_blocks: Callable[[np.ndarray], np.ndarray]
    dequantize_blocks: Callable[[np.ndarray], np.ndarray]


def _qt(name, ggml_type, block_size, type_size, q, dq) -> QuantType:
    return QuantType(name, ggml_type, block_size, type_size, type_size * 8 / block_size, q, dq)


_T = GGMLQuantizationType
QUANT_TYPES: dict[str, QuantType] = {
    t.name: t
    for t in (
        _qt("q8_0", _T.Q8_0, 32, 34, legacy.quantize_q8_0, legacy.dequantize_q8_0),
        _qt("q4_0", _T.Q4_0, 32, 18, legacy.quantize_q4_0, legacy.dequantize_q4_0),
        _qt("q4_1", _T.Q4_1, 32, 20, legacy.quantize_q4_1, legacy.dequantize_q4_1),
        _qt("q5_0", _T.Q5_0, 32, 22, legacy.quantize_q5_0, legacy.dequantize_q5_0),
        _qt("q5_1", _T.Q5_1, 32, 24, legacy.quantize_q5_1, legacy.dequantize_q5_1),
        _qt("q2k", _T.Q2_K, 256, 84, kquants.quantize_q2k, kquants.dequantize_q2k),
        _qt("q3k", _T.Q3_K, 256, 110, kquants.quantize_q3k, kquants.dequantize_q3k),
        _qt("q4k", _T.Q4_K, 256, 144, kquants.quantize_q4k, kquants.dequantize_q4k),
        _qt("q5k", _T.Q5_K, 256, 176, kquants.quantize_q5k, kquants.dequantize_q5k),
        _qt("q6k", _T.Q6_K, 256, 210, kquants.quantize_q6k, kquants.dequantize_q6k),
    )
}

# Blocks handled per numpy call: keeps the temporaries cache-sized and bounds peak memory.
_CHUNK_WEIGHTS = 1 << 17


def _lookup(name: str) -> QuantType:
    qt = QUANT_TYPES.get(name)
    if qt is None:
        raise ValueError(
            f"unknown quantization type {name!r}; valid names: {', '.join(QUANT_TYPES)}"
        )
    return qt


def _map_chunks(fn: Callable[[np.ndarray], np.ndarray], src: np.ndarray, out: np.ndarray, n: int):
    """out[i:j] = fn(src[i:j]) over chunks of n rows, spread over the available cores."""
    total = src.shape[0]
    bounds = [(i, min(i + n, total)) for i in range(0, total, n)]

    def work(b: tuple[int, int]) -> None:
        out[b[0] : b[1]] = fn(src[b[0] : b[1]])

    workers = min(len(bounds), os.cpu_count() or 1)
    if workers <= 1:
        for b in bounds:
            work(b)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(work, bounds))


def quantize(array: np.ndarray, name: str) -> np.ndarray:
    """Quantize ``array`` (last dimension = row) to ``uint8[rows, row_bytes]``."""
    qt = _lookup(name)
    array = np.asarray(array)
    if array.ndim == 0 or array.shape[-1] % qt.block_size != 0 or array.shape[-1] == 0:
        raise ValueError(
            f"cannot quantize array of shape {tuple(array.shape)} to {name}: the row length "
            f"must be a positive multiple of the block size {qt.block_size}"
        )
    row_len = array.shape[-1]
    rows = array.size // row_len
    blocks = np.ascontiguousarray(array, dtype=np.float32).reshape(-1, qt.block_size)
    out = np.empty((blocks.shape[0], qt.type_size), dtype=np.uint8)
    chunk = max(1, _CHUNK_WEIGHTS // qt.block_size)
    _map_chunks(qt.quantize_blocks, blocks, out, chunk)
    return out.reshape(rows, row_len // qt.block_size * qt.type_size)


def dequantize(blocks: np.ndarray, name: str, shape: Sequence[int]) -> np.ndarray:
    """Decode ``blocks`` (any shape holding the raw bytes) into float32 of ``shape``."""
    qt = _lookup(name)
    shape = tuple(int(s) for s in shape)
    n = int(np.prod(shape)) if shape else 1
    if not shape or shape[-1] % qt.block_size != 0:
        raise ValueError(
            f"cannot dequantize to shape {shape} as {name}: the row length must be a multiple "
            f"of the block size {qt.block_size}"
        )
    raw = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1)
    n_blocks = n // qt.block_size
    if raw.size != n_blocks * qt.type_size:
        raise ValueError(
            f"{name} data of {raw.size} bytes does not match shape {shape} "
            f"({n_blocks} blocks of {qt.type_size} bytes)"
        )
    raw = raw.reshape(n_blocks, qt.type_size)
    out = np.empty((n_blocks, qt.block_size), dtype=np.float32)
    _map_chunks(qt.dequantize_blocks, raw, out, max(1, _CHUNK_WEIGHTS // qt.block_size))
    return out.reshape(shape)
