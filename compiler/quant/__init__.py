"""Weight block formats: the registry (`QUANT_FORMATS`) and numpy quantize / dequantize.

Each format family is one package that registers its formats (`legacy`, `kquants`,
`iquants`, `lowbit` (TQ1_0, TQ2_0, MXFP4), `grids` (the lattice i-quants, read only);
see `format.QuantFormat` for what a format holds and `registry` for the table).

``quantize(array, name)`` turns a float array whose last dimension is a multiple of the type's
block size into ``uint8[rows, row_bytes]`` laid out byte for byte as llama.cpp / GGUF store the
blocks; ``dequantize(blocks, name, shape)`` is the matching numpy decoder.

The legacy types (q4_0, q4_1, q5_0, q5_1, q8_0) reproduce ``gguf.quants.quantize`` bit for bit.
The K-quants (q2k..q6k) use a search for sub-block scales in the spirit of ggml's reference
quantizers (see :mod:`.kquants.scale_search`); their blocks decode with ``gguf.quants.dequantize``.
The i-quants (iq4_nl, iq4_xs) search each group's scale against their non-linear table
(:mod:`.iquants.numpy_codec`), without an importance matrix.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import grids, iquants, kquants, legacy, lowbit  # noqa: F401 - families register themselves
from .format import Int8Codes, Lazy, LeadingScale, QuantFormat
from .registry import (
    QUANT_FORMATS,
    format_for_ggml_type,
    get_format,
    register_format,
    unregister_format,
)

__all__ = [
    "QUANT_FORMATS",
    "Int8Codes",
    "Lazy",
    "LeadingScale",
    "QuantFormat",
    "dequantize",
    "format_for_ggml_type",
    "get_format",
    "quantize",
    "register_format",
    "unregister_format",
]

# Blocks handled per numpy call: keeps the temporaries cache-sized and bounds peak memory.
_CHUNK_WEIGHTS = 1 << 17


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
    qt = get_format(name)
    if qt.quantize_blocks is None:
        raise ValueError(f"cannot quantize to {name}: {qt.no_quantizer}")
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
    qt = get_format(name)
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
