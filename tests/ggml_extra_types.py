"""The test oracle for GGML block types the `gguf` package (0.19) does not decode: Q1_0.

Written here from the format's definition, not from tallow's decoder (128 weights in 18
bytes: an f16 scale `d`, then 16 bytes whose bit `j % 8` of byte `j // 8` is weight `j`'s
sign: `+d` when set, `-d` when clear), and registered into `gguf.quants` so that every
test calling `gguf.quants.dequantize` (the oracle of the kernels' tests) takes it as it
takes the package's own. `test_llamacpp_blocks.py` checks it, and tallow's decoders,
against llama.cpp's own dequantizer (`tests/data/llamacpp_blocks.npz`). Imported by
conftest.py; a gguf release that adds the type makes this a no-op.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf.quants import _type_traits

_Quant = getattr(gguf.quants, "__Quant")  # the package's base class (module-private name)


def _q1_0_reference(blocks: np.ndarray) -> np.ndarray:
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    signs = np.empty((blocks.shape[0], 128), np.float32)
    for j in range(128):
        set_ = (blocks[:, 2 + j // 8] >> (j % 8)) & 1
        signs[:, j] = np.where(set_ == 1, 1.0, -1.0)
    return d * signs


if gguf.GGMLQuantizationType.Q1_0 not in _type_traits:

    class Q1_0(_Quant, qtype=gguf.GGMLQuantizationType.Q1_0):
        @classmethod
        def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
            return _q1_0_reference(blocks)
