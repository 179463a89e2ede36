"""An IQ3_XXS quantizer in numpy: what `--quant iq3_xxs` writes.

IQ3_XXS (3.06 bits a weight) stores each 4 weights' magnitudes as one of 256 grid entries
(values 4, 12, .., 52, 62), a 4-bit scale `s` per 32 weights and one f16 `d` per 256:
weight = d * (0.5 + s) / 2 * grid value * sign (`gguf`'s `IQ3_XXS`). Signs come 7 to 8
weights: the 8th is whatever makes the count of negative weights even (llama.cpp's
`ksigns_iq2xs`), so a group of 8 with an odd count must give one weight the wrong sign.
llama.cpp's block quantizer (`ggml_quantize_chunk`) writes it without an importance matrix;
its IQ3_XXS recipe (`llama_model_quantize`, 0.3.36) asks for one, so `--quant iq3_xxs` is
every weight in IQ3_XXS (`quant.mixes`).

The grid search is `lattice_search` (shared with IQ3_S), in units of 4: magnitudes d * (1 +
2s) * level with levels 1, 3, .., 13, 15.5. The sign: in a group of 8 with an odd count of
negative weights, the weight whose flip costs least (4 |x| times its magnitude: a zero or
tiny weight, a small level) takes the wrong sign, and that cost is part of the error by which
each group's 4-bit scale is chosen.

Quality: `tests/test_llamacpp_blocks.py` (llama.cpp's blocks on the same rows in its fixture)
and the RMS bound of `tests/test_quantizers.py`.
"""

from __future__ import annotations

import numpy as np

from .lattice_search import GROUP, GROUPS, Lattice

LATTICE = Lattice("iq3_xxs", 4.0)
SIGNED = 8  # weights a sign code covers (7 stored bits and the parity)


def _flip_costs(x: np.ndarray, idx: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[n, 8, 4, 8]: the squared error a weight adds when it takes the wrong sign."""
    q = LATTICE.values(idx, x.shape) * scale[..., None]
    return (4 * np.abs(x) * q).reshape(*x.shape[:-1], GROUP // SIGNED, SIGNED)


def _odd(x: np.ndarray) -> np.ndarray:
    """[n, 8, 4] whether a group of 8 holds an odd count of negative weights."""
    negative = (x < 0).reshape(*x.shape[:-1], GROUP // SIGNED, SIGNED)
    return negative.sum(axis=-1) % 2 == 1


def parity_cost(x: np.ndarray, idx: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[n, 8] per 32-weight group: the wrong signs' squared error."""
    cheapest = _flip_costs(x, idx, scale).min(axis=-1)
    return (cheapest * _odd(x)).sum(axis=-1).astype(np.float32)


def quantize_iq3_xxs(x: np.ndarray) -> np.ndarray:
    """[n, 256] float -> [n, 98] uint8 IQ3_XXS blocks."""
    n = x.shape[0]
    x = x.astype(np.float32).reshape(n, GROUPS, GROUP)
    c = LATTICE.search(x, parity_cost)
    idx = c.idx.reshape(n, GROUPS, -1)
    negative = (x < 0).reshape(n, GROUPS, GROUP // SIGNED, SIGNED)
    flip = _flip_costs(x, idx, c.scale).argmin(axis=-1)  # [n, 8, 4]
    odd = _odd(x)
    np.put_along_axis(
        negative,
        flip[..., None],
        np.take_along_axis(negative, flip[..., None], axis=-1) ^ odd[..., None],
        axis=-1,
    )
    bits = np.packbits(negative, axis=-1, bitorder="little")[..., 0].astype(np.uint32)
    words = (bits & 0x7F) << (7 * np.arange(GROUP // SIGNED, dtype=np.uint32))
    words = words.sum(axis=-1, dtype=np.uint32) | (c.s.astype(np.uint32) << 28)  # [n, 8]
    return np.concatenate(
        [
            c.d_bytes,
            c.idx.astype(np.uint8),
            words.astype("<u4").view(np.uint8).reshape(n, -1),
        ],
        axis=1,
    )
