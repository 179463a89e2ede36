"""An IQ3_S quantizer in numpy: what `--quant iq3_s` writes.

IQ3_S (3.44 bits a weight) stores each 4 weights' magnitudes as one of 512 grid entries
(4 odd values 1..15 each), a sign bit per weight, a 4-bit scale `s` per 32 weights and one
f16 `d` per 256: weight = d * (1 + 2s) * grid value * sign (`decoders.iq3_s`). llama.cpp
writes it without an importance matrix.

The grid search is `lattice_search` (shared with IQ3_XXS); the signs are stored as they are.

Quality: on Gaussian weights (256 x 4096, and the same scaled per row with heavy tails) its
relative RMS error is 15.3% and 15.6% where llama.cpp's IQ3_S quantizer (`ggml_quantize_chunk`,
no importance matrix) gives 16.6% and 16.9% on the same weights, and llama.cpp's Q3_K (3.44
bits a weight too) 15.1% and 15.5%; on cubed Gaussian (heavy-tailed) rows 24.5% against
llama.cpp's 32.3% (`tests/test_llamacpp_blocks.py`, llama.cpp's blocks in its fixture).
"""

from __future__ import annotations

import numpy as np

from .lattice_search import BLOCK, GROUP, GROUPS, Lattice, no_extra

LATTICE = Lattice("iq3_s", 1.0)


def quantize_iq3_s(x: np.ndarray) -> np.ndarray:
    """[n, 256] float -> [n, 110] uint8 IQ3_S blocks."""
    n = x.shape[0]
    x = x.astype(np.float32).reshape(n, GROUPS, GROUP)
    c = LATTICE.search(x, no_extra)
    return _pack(n, c.d_bytes, c.idx, c.s, x.reshape(n, BLOCK) < 0)


def _pack(n, d_bytes, idx, s, negative) -> np.ndarray:
    """The 110 bytes: d, the entries' low bytes, their 9th bits, the signs, the scales."""
    low = (idx & 0xFF).astype(np.uint8)  # [n, 64]
    high = np.packbits(
        (idx >> 8).astype(np.uint8).reshape(n, GROUPS, 8), axis=-1, bitorder="little"
    )
    signs = np.packbits(negative.reshape(n, -1, 8), axis=-1, bitorder="little")
    pairs = s.reshape(n, GROUPS // 2, 2).astype(np.uint8)
    scales = pairs[..., 0] | (pairs[..., 1] << 4)
    return np.concatenate(
        [d_bytes, low, high.reshape(n, GROUPS), signs.reshape(n, -1), scales], axis=1
    )
