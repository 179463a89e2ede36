"""Quantized weights with f16 / bf16 activations (issue 19, item 1), on the CPU.

The fused dequantize-matmul of every GGUF block format, built by the CPU backend's own
pipeline for a half-precision compute dtype (its int8-activation decode kernels take f32
only, so these get the generic schedules), against numpy on gguf's dequantizer at the same
dtype: each weight is gguf's f32 value rounded once to the dtype, the products are summed
in float32, the result rounded once to the dtype.

One exception, TVM's and not ours: on the CPU, TVM computes bf16 in float32 (LLVM has no
bf16 arithmetic on x86; its bf16 legalization drops the f32 -> bf16 -> f32 round trip of a
value that never leaves registers), so a bf16 kernel's weights stay gguf's exact f32 values
there (seen: its output equals numpy's f32-weight product rounded to bf16 bit for bit). The
oracle follows: `CPU_WEIGHTS`.

Tolerance, from that arithmetic: |out - exact| <= u * |exact| + (K + 2) * 2**-24 * sum|x*w|
(one rounding to the dtype, unit roundoff u = 2**-11 for f16, 2**-8 for bf16, plus the
worst case of a float32 sum of K terms; a product of two halves is exact in float32).
A sum kept in f16 or bf16 misses it by far (its rounding error grows with every term);
so does any weight that is not gguf's value rounded to the dtype.
"""

from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np
import pytest
import tvm
from quant_blocks import weight_blocks
from tvm import relax
from tvm.relax.frontend import nn

from tallow.compiler.backends import resolve_target
from tallow.compiler.quant import QUANT_FORMATS
from tallow.compiler.relax_pipeline import lower_module
from tallow.model_defs.quant_ops import QuantLinear

NUMPY = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
FLAG = {"float16": "f16", "bfloat16": "bf16"}
# the weights a CPU kernel multiplies: rounded to f16; bf16 legalized to f32 (see above)
CPU_WEIGHTS = {"float16": np.float16, "bfloat16": np.float32}


class _Projections(nn.Module):
    """One quantized projection per format, each called as prefill (`[1, tokens, K]`) and
    as batched decode (`[batch, 1, K]`): the CPU schedules them differently. All formats in
    one module: one build per dtype."""

    def __init__(self, k, n, dtype):
        self.proj = nn.ModuleList([QuantLinear(k, n, q, out_dtype=dtype) for q in QUANT_FORMATS])

    def prefill(self, x, i):
        return self.proj[i](x)


def _build(dtype: str, k: int, n: int):
    mod = None
    spec_of = {}
    for i, qtype in enumerate(QUANT_FORMATS):
        spec_of[f"prefill_{qtype}"] = (i, [1, "s", k])
        spec_of[f"decode_{qtype}"] = (i, ["b", 1, k])
    module = _Projections(k, n, dtype)
    for name, (i, _) in spec_of.items():
        setattr(module, name, lambda x, i=i: module.prefill(x, i))
    mod, _ = module.export_tvm(
        {name: {"x": nn.spec.Tensor(shape, dtype)} for name, (_, shape) in spec_of.items()}
    )
    spec = resolve_target("cpu", FLAG[dtype])
    mod = lower_module(mod, spec)
    # the int8-activation kernels (f32 only) stay out, and the manifest says what decode reads
    assert spec.report.int8_decode_kernels in (None, 0)
    assert spec.report.decode_activations in (None, dtype)  # None: no AVX2, no int8 pass
    target = spec.tvm()
    with target:
        ex = tvm.compile(mod, target, relax_pipeline=None)
    return relax.VirtualMachine(ex, tvm.cpu())


def _check(out: np.ndarray, x: np.ndarray, w: np.ndarray, dtype: str) -> float:
    """The worst error over the bound (<= 1 passes)."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    exact = x64 @ w64.T
    k = x.shape[-1]
    bound = UNIT_ROUNDOFF[dtype] * np.abs(exact) + (k + 2) * 2.0**-24 * (
        np.abs(x64) @ np.abs(w64).T
    )
    return float((np.abs(out.astype(np.float64) - exact) / bound).max())


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_half_quant_matmul_matches_gguf(dtype):
    k, n = 512, 48
    vm = _build(dtype, k, n)
    rng = np.random.default_rng(11)
    blocks, ref_w = {}, {}
    for qtype, fmt in QUANT_FORMATS.items():
        w32 = rng.standard_normal((n, k)).astype(np.float32) * 0.5 + 0.05
        blocks[qtype] = weight_blocks(w32, qtype)
        # the oracle's weights: gguf's dequantized f32 values (rounded once to f16)
        w = gguf.quants.dequantize(blocks[qtype], fmt.ggml_type).reshape(n, k)
        ref_w[qtype] = np.asarray(w, np.float32).astype(CPU_WEIGHTS[dtype])
    weights = [tvm.runtime.tensor(b) for b in blocks.values()]  # every function takes all
    worst = {}
    for qtype in QUANT_FORMATS:
        for fn, shape in (("prefill", (1, 19, k)), ("decode", (5, 1, k)), ("decode", (1, 1, k))):
            x = rng.standard_normal(shape).astype(np.float32).astype(NUMPY[dtype])
            out = vm[f"{fn}_{qtype}"](tvm.runtime.tensor(x), *weights).numpy()
            assert out.dtype == NUMPY[dtype]
            worst[f"{qtype} {fn} {shape}"] = _check(
                out.reshape(-1, n), x.reshape(-1, k), ref_w[qtype], dtype
            )
    bad = {what: round(r, 2) for what, r in worst.items() if r > 1.0}
    assert not bad, f"error over the bound (x the bound): {bad}"
