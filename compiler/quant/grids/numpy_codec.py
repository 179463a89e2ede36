"""The lattice i-quants' numpy decoders: `decoders` run on whole arrays of blocks.

No quantizers: llama.cpp's IQ1/IQ2/IQ3 quantizers search the grid for each 8 (or 4)
weights, and its recipes for IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M require an importance
matrix; tallow reads and runs these formats (what users with IQ2_M / IQ3_M / "dynamic"
GGUFs need) but does not write them.
"""

from __future__ import annotations

import numpy as np

from . import decoders
from .tables import grid_bytes

BLOCK = 256
_J = np.arange(BLOCK)


class _Reader:
    """Columns of many blocks at once: `byte(off)` is [n, 256] (or [n, 1] for a fixed
    offset), every value of the int64 integers the decoders' bit operations expect."""

    def __init__(self, blocks: np.ndarray, name: str):
        self.blocks = blocks
        self.table = grid_bytes(name).astype(np.int64)

    def byte(self, off):
        off = np.asarray(off)
        col = self.blocks[:, off].astype(np.int64)
        return col[:, None] if off.ndim == 0 else col

    def f16(self, bits):
        return np.ascontiguousarray(bits.astype(np.uint16)).view(np.float16).astype(np.float32)

    def grid(self, i):
        return self.table[i]

    @staticmethod
    def f32(x):
        return np.asarray(x).astype(np.float32)


def decoder(name: str):
    """[n, type_size] uint8 blocks -> [n, 256] float32, for format `name`."""
    decode = getattr(decoders, name)

    def dequantize_blocks(blocks: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            out = decode(_Reader(blocks, name), _J)
        return np.broadcast_to(out, (blocks.shape[0], BLOCK)).astype(np.float32)

    dequantize_blocks.__name__ = f"dequantize_{name}"
    return dequantize_blocks
