"""The grid search of tallow's IQ3 quantizers (`quantize_iq3_s`, `quantize_iq3_xxs`), in numpy.

Both formats store each 4 weights' magnitudes as one entry of a grid (512 entries for IQ3_S,
256 for IQ3_XXS) whose values are 8 levels, a 4-bit scale `s` per 32 weights and one f16 `d`
per 256: magnitude = d * (1 + 2s) * level. IQ3_S's levels are the odd values 1..15; IQ3_XXS
stores 4x them (4, 12, .., 52) with the last 62, so its levels are 1, 3, .., 13, 15.5 in the
same units. A `Lattice` holds one grid in those units.

How, per 32-weight group (all groups of all blocks at once):

* the nearest entry to 4 magnitudes: each magnitude over the group's scale rounded to the
  nearest level gives one of 8**4 tuples, and a table made once maps every tuple to its
  nearest grid entry (`nearest_entry`). A lookup per 4 weights, where comparing with all
  entries would cost 256-512;
* the group's scale: `CANDIDATES` starting scales (the largest magnitude over a level from
  15 down to 1), each giving entries, then the least-squares scale for those entries; the
  candidate with the smallest squared error wins;
* the block's `d` makes the largest group scale `d * 31`; each group then takes the 4-bit
  `s` nearest its scale or a neighbour, whichever fits its weights best with its entries
  chosen again (as `quantize_iq4_xs` picks its group scales). A format may add a cost per
  group to that choice (IQ3_XXS: the sign it cannot store, `quantize_iq3_xxs`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..iquants.numpy_codec import _f16_bytes, _f16_value
from .tables import grid_bytes

F32 = np.float32
BLOCK, GROUP, ENTRY = 256, 32, 4  # weights a block, a scale group, a grid entry
GROUPS = BLOCK // GROUP
LEVELS = 8
MAX_S = 15  # the 4-bit group scale: (1 + 2s) up to 31
# the largest magnitude's starting level: 15 down to 9 by halves, then the low odd levels
# (a constant group fits only an entry of four equal levels, which IQ3_S's grid holds only
# at 1)
CANDIDATES = np.concatenate([np.linspace(15.0, 9.0, 13), [7.0, 5.0, 3.0, 1.0]]).astype(F32)


@dataclass(frozen=True)
class Choice:
    """A block row's encoding: d's f16 bytes [n, 2], group scales s [n, 8], entries [n, 64],
    and each group's scale d * (1 + 2s) [n, 8]."""

    d_bytes: np.ndarray
    s: np.ndarray
    idx: np.ndarray
    scale: np.ndarray


@dataclass(frozen=True)
class Lattice:
    name: str  # the format whose grid it is
    unit: float  # the grid's stored values over the levels (IQ3_S 1, IQ3_XXS 4)

    @functools.cached_property
    def grid(self) -> np.ndarray:
        """[entries, 4] float32 levels."""
        return grid_bytes(self.name).reshape(-1, ENTRY).astype(F32) / F32(self.unit)

    @functools.cached_property
    def levels(self) -> np.ndarray:
        return np.unique(self.grid)

    @functools.cached_property
    def nearest_entry(self) -> np.ndarray:
        """[8**4] int32: the grid entry nearest each tuple of 4 levels, tuple index
        sum(level_index_i * 8**(3 - i))."""
        v = self.levels
        tuples = np.stack(np.meshgrid(v, v, v, v, indexing="ij"), axis=-1)
        dist = ((tuples.reshape(-1, 1, ENTRY) - self.grid[None]) ** 2).sum(axis=-1)
        return dist.argmin(axis=1).astype(np.int32)

    def entries(self, mag: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """Grid indices [..., 8] for magnitudes [..., 32] at group scales [...]."""
        inv = np.zeros_like(scale)
        np.divide(F32(1), scale, out=inv, where=scale > 0)
        bounds = (self.levels[1:] + self.levels[:-1]) / 2  # the nearest of the 8 levels
        index = np.searchsorted(bounds, mag * inv[..., None]).astype(np.int32)
        index = index.reshape(*mag.shape[:-1], GROUP // ENTRY, ENTRY)
        tuple_index = ((index[..., 0] * LEVELS + index[..., 1]) * LEVELS + index[..., 2]) * LEVELS
        return self.nearest_entry[tuple_index + index[..., 3]]

    def values(self, idx: np.ndarray, shape) -> np.ndarray:
        return self.grid[idx].reshape(shape)

    def fit(self, mag: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(least-squares scale, squared error at it) of magnitudes [..., 32] on entries."""
        q = self.values(idx, mag.shape)
        qq = (q * q).sum(axis=-1)
        aq = (mag * q).sum(axis=-1)
        scale = aq / qq  # qq >= 32: every level is at least 1
        return scale, (mag * mag).sum(axis=-1) - aq * scale

    def search(
        self, x: np.ndarray, extra: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    ) -> Choice:
        """Encode [n, 8, 32] weights; `extra(x, idx, scale)` [n, 8] is a format's own cost of
        a group's choice, added to its squared error when `s` is picked."""
        n = x.shape[0]
        mag = np.abs(x)
        amax = mag.max(axis=-1)
        best_scale = np.zeros((n, GROUPS), F32)
        best_err = np.full((n, GROUPS), np.inf, F32)
        for level in CANDIDATES:
            scale, err = self.fit(mag, self.entries(mag, amax / level))
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_scale = np.where(better, scale, best_scale)
        d_bytes = _f16_bytes(best_scale.max(axis=1) / F32(2 * MAX_S + 1))
        d = _f16_value(d_bytes)  # [n, 1]
        inv = np.zeros_like(d)
        np.divide(F32(1), d, out=inv, where=d > 0)
        nearest = np.rint((best_scale * inv - 1) / 2)
        best_s = np.zeros((n, GROUPS), np.int32)
        best_idx = np.zeros((n, GROUPS, GROUP // ENTRY), np.int32)
        best_err = np.full((n, GROUPS), np.inf, F32)
        for step in (0, -1, 1):
            s = np.clip(nearest + step, 0, MAX_S).astype(np.int32)
            scale = d * (1 + 2 * s).astype(F32)
            idx = self.entries(mag, scale)
            q = self.values(idx, mag.shape)
            err = ((mag - scale[..., None] * q) ** 2).sum(axis=-1) + extra(x, idx, scale)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s = np.where(better, s, best_s)
            best_idx = np.where(better[..., None], idx, best_idx)
        return Choice(d_bytes, best_s, best_idx.reshape(n, -1), d * (1 + 2 * best_s).astype(F32))


def no_extra(x: np.ndarray, idx: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.zeros(scale.shape, F32)
