"""An IQ3_S quantizer in numpy: what `--quant iq3_s` writes.

IQ3_S (3.44 bits a weight) stores each 4 weights' magnitudes as one of 512 grid entries
(4 odd values 1..15 each), a sign bit per weight, a 4-bit scale `s` per 32 weights and one
f16 `d` per 256: weight = d * (1 + 2s) * grid value * sign (`decoders.iq3_s`). llama.cpp
writes it without an importance matrix.

How, per 32-weight group (all groups of all blocks at once):

* the nearest entry to 4 magnitudes: each magnitude over the group's scale rounded to the
  nearest odd level 1..15 gives one of 8**4 tuples, and a table made once maps every tuple
  to its nearest grid entry (`_nearest_entry`: the grid holds 512 of the 4096 tuples). A
  lookup per 4 weights, where comparing with all 512 entries would cost 512;
* the group's scale: `_CANDIDATES` starting scales (the largest magnitude over a level
  from 15 down to 1), each giving entries, then the least-squares scale for those entries;
  the candidate with the smallest squared error wins;
* the block's `d` makes the largest group scale `d * 31`; each group then takes the 4-bit
  `s` nearest its scale or a neighbour, whichever fits its weights best with its entries
  chosen again (as `quantize_iq4_xs` picks its group scales).

Quality: on Gaussian weights (256 x 4096, and the same scaled per row with heavy tails) its
relative RMS error is 15.3% and 15.6% where llama.cpp's IQ3_S quantizer (`ggml_quantize_chunk`,
no importance matrix) gives 16.6% and 16.9% on the same weights, and llama.cpp's Q3_K (3.44
bits a weight too) 15.1% and 15.5%; on cubed Gaussian (heavy-tailed) rows 24.5% against
llama.cpp's 32.3% (`tests/test_llamacpp_blocks.py`, llama.cpp's blocks in its fixture).
"""

from __future__ import annotations

import functools

import numpy as np

from ..iquants.numpy_codec import _f16_bytes, _f16_value
from .tables import grid_bytes

_F32 = np.float32
BLOCK, GROUP, ENTRY = 256, 32, 4  # weights a block, a scale group, a grid entry
GROUPS = BLOCK // GROUP
LEVELS = 8  # odd values 1, 3, .., 15
MAX_S = 15  # the 4-bit group scale: (1 + 2s) up to 31
# the largest magnitude's starting level: 15 down to 9 by halves, then the low odd levels
# (a constant group fits only the entry 1, 1, 1, 1: the grid holds no other equal four)
_CANDIDATES = np.concatenate([np.linspace(15.0, 9.0, 13), [7.0, 5.0, 3.0, 1.0]]).astype(_F32)


@functools.cache
def _grid() -> np.ndarray:
    return grid_bytes("iq3_s").reshape(-1, ENTRY).astype(_F32)  # [512, 4]


@functools.cache
def _nearest_entry() -> np.ndarray:
    """[8**4] int32: the grid entry nearest each tuple of 4 odd levels, tuple index
    sum(level_i * 8**(3 - i)) with level (value - 1) / 2."""
    values = np.arange(1, 2 * LEVELS, 2, dtype=_F32)
    tuples = np.stack(np.meshgrid(values, values, values, values, indexing="ij"), axis=-1)
    dist = ((tuples.reshape(-1, 1, ENTRY) - _grid()[None]) ** 2).sum(axis=-1)
    return dist.argmin(axis=1).astype(np.int32)


def _entries(mag: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Grid indices [..., 8] for magnitudes [..., 32] at group scales [...]."""
    inv = np.zeros_like(scale)
    np.divide(_F32(1), scale, out=inv, where=scale > 0)
    level = np.clip(np.rint((mag * inv[..., None] - 1) / 2), 0, LEVELS - 1).astype(np.int32)
    level = level.reshape(*mag.shape[:-1], GROUP // ENTRY, ENTRY)
    tuple_index = ((level[..., 0] * LEVELS + level[..., 1]) * LEVELS + level[..., 2]) * LEVELS
    return _nearest_entry()[tuple_index + level[..., 3]]


def _fit(mag: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(least-squares scale, squared error at it) of magnitudes [..., 32] on entries idx."""
    q = _grid()[idx].reshape(mag.shape)
    qq = (q * q).sum(axis=-1)
    aq = (mag * q).sum(axis=-1)
    scale = aq / qq  # qq >= 32: every grid value is at least 1
    return scale, (mag * mag).sum(axis=-1) - aq * scale


def _error(mag: np.ndarray, idx: np.ndarray, scale: np.ndarray) -> np.ndarray:
    q = _grid()[idx].reshape(mag.shape)
    return ((mag - scale[..., None] * q) ** 2).sum(axis=-1)


def quantize_iq3_s(x: np.ndarray) -> np.ndarray:
    """[n, 256] float -> [n, 110] uint8 IQ3_S blocks."""
    n = x.shape[0]
    x = x.astype(_F32).reshape(n, GROUPS, GROUP)
    mag = np.abs(x)
    amax = mag.max(axis=-1)
    best_scale = np.zeros((n, GROUPS), _F32)
    best_err = np.full((n, GROUPS), np.inf, _F32)
    for level in _CANDIDATES:
        scale, err = _fit(mag, _entries(mag, amax / level))
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
    d_bytes = _f16_bytes(best_scale.max(axis=1) / _F32(2 * MAX_S + 1))
    d = _f16_value(d_bytes)  # [n, 1]
    inv = np.zeros_like(d)
    np.divide(_F32(1), d, out=inv, where=d > 0)
    nearest = np.rint((best_scale * inv - 1) / 2)
    best_s = np.zeros((n, GROUPS), np.int32)
    best_idx = np.zeros((n, GROUPS, GROUP // ENTRY), np.int32)
    best_err = np.full((n, GROUPS), np.inf, _F32)
    for step in (0, -1, 1):
        s = np.clip(nearest + step, 0, MAX_S).astype(np.int32)
        scale = d * (1 + 2 * s).astype(_F32)
        idx = _entries(mag, scale)
        err = _error(mag, idx, scale)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s, best_s)
        best_idx = np.where(better[..., None], idx, best_idx)
    return _pack(n, d_bytes, best_idx.reshape(n, -1), best_s, x.reshape(n, BLOCK) < 0)


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
