"""Weight blocks of any registered format for tests: tallow's quantizer where the format has
one, else (the lattice i-quants, which tallow reads but does not write) random valid blocks
whose weights have about the RMS of the array they stand for.

The oracles of the tests that use these compare against what `gguf.quants.dequantize`
decodes from the blocks, whatever the blocks are, so random blocks test the decoders and
kernels as well as quantized ones do (every grid entry, sign and scale is reachable).
"""

from __future__ import annotations

import numpy as np

from tallow.compiler.quant import QUANT_FORMATS, dequantize, quantize


def set_scale(blocks: np.ndarray, qtype: str, d: np.ndarray) -> None:
    """Write the f16 super-block scale `d` ([n]) of each block, in place: bytes 0-1, except
    iq1_m, which keeps its 16 bits in the top nibbles of bytes 49, 51, 53 and 55."""
    bits = np.asarray(d, np.float16).reshape(-1).view(np.uint16).astype(np.uint32)
    if qtype == "iq1_m":
        for i, at in enumerate((49, 51, 53, 55)):
            nibble = ((bits >> (4 * i)) & 15).astype(np.uint8)
            blocks[:, at] = (blocks[:, at] & 15) | (nibble << 4)
    else:
        blocks[:, 0:2] = bits.astype(np.uint16).view(np.uint8).reshape(-1, 2)


def weight_blocks(x: np.ndarray, qtype: str, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] blocks standing for float weights `x` [rows, cols]."""
    fmt = QUANT_FORMATS[qtype]
    if fmt.quantize_blocks is not None:
        return quantize(x, qtype)
    rows, cols = x.shape
    n = rows * cols // fmt.block_size
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, fmt.type_size), dtype=np.uint8)
    set_scale(blocks, qtype, np.ones(n))
    unit = dequantize(blocks, qtype, (n, fmt.block_size))
    rms = np.sqrt(np.mean(unit.astype(np.float64) ** 2, axis=1)) + 1e-30
    target = np.sqrt(np.mean(x.astype(np.float64) ** 2)) + 1e-30
    set_scale(blocks, qtype, target / rms * rng.uniform(0.5, 1.5, n))
    return blocks.reshape(rows, -1)


def tir_dequantize(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [n, block_size]: the TE dequantization every fused dequantize-matmul is built
    from (`quant_ops.dequantize_te`), compiled for the CPU and run on `n` blocks."""
    import tvm
    from tvm import te

    from tallow.model_defs.quant_ops import dequantize_te

    fmt = QUANT_FORMATS[qtype]
    rows, cols = len(blocks), fmt.block_size
    w = te.placeholder((rows, fmt.type_size), "uint8", name="w")
    func = te.create_prim_func([w, dequantize_te(w, qtype, rows, cols)])
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.empty((rows, cols), "float32")
    lib["main"](tvm.runtime.tensor(np.ascontiguousarray(blocks)), out)
    return out.numpy()
