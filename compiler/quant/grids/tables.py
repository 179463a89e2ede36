"""The lattice grids of the IQ1/IQ2/IQ3 formats, taken from the `gguf` package.

The grids are format data (llama.cpp's, 256 to 2048 entries of 4 or 8 small values), not
something tallow derives: `gguf` ships them (hex-packed) for its own dequantizers, and it
is maintained with llama.cpp, so they are read from there rather than pasted here. A grid
is handed to the decoders as one flat uint8 table, entry-major (`grid[q * width + t]`):
IQ2's values 8, 25, 43; IQ3_XXS's 4..62; IQ3_S's 1..15; IQ1's -1, 0, 1 stored plus one
(the decoder subtracts it back: a uint8 table is what the CPU schedule's block checks and
every backend's byte loads take).
"""

from __future__ import annotations

from functools import cache

import numpy as np

# tallow's name -> the gguf.quants class holding the grid, and the bias that makes its
# values bytes
_SOURCES = {
    "iq2_xxs": ("IQ2_XXS", 0),
    "iq2_xs": ("IQ2_XS", 0),
    "iq2_s": ("IQ2_S", 0),
    "iq3_xxs": ("IQ3_XXS", 0),
    "iq3_s": ("IQ3_S", 0),
    "iq1_s": ("IQ1_S", 1),
    "iq1_m": ("IQ1_M", 1),
}


@cache
def grid_bytes(name: str) -> np.ndarray:
    """The grid of format `name` as uint8 [entries * width] (read-only)."""
    from gguf import quants

    cls = getattr(quants, _SOURCES[name][0])
    cls.init_grid()
    values = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape) + _SOURCES[name][1]
    table = values.astype(np.uint8).reshape(-1)
    if not np.array_equal(table.astype(np.float32), values.reshape(-1)):
        raise ValueError(f"{name}: the gguf grid does not hold small non-negative integers")
    table.setflags(write=False)
    return table
