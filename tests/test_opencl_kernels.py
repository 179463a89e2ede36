"""GPU-scheduled kernels run on the CPU: scheduled as for a CUDA artifact, emitted as OpenCL C
and launched with pyopencl on PoCL (`tests/opencl_runner.py`; docs/gpu-artifacts.md).

Oracles: the `gguf` dequantizers + numpy for the quantized matmuls (decode, batched decode and
prefill shapes, tails that fill no whole tile), numpy for RMSNorm, the host sampler's numpy
code for the GPU token sampler. Needs Debian pocl-opencl-icd + ocl-icd-libopencl1 and PyPI
pyopencl; skips naming what is missing.
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest

from opencl_runner import OpenCLKernels, cuda_scheduled, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

tvm = pytest.importorskip("tvm")

from tvm.relax.frontend import nn  # noqa: E402

from tallow.compiler.quant import QUANT_FORMATS, quantize  # noqa: E402
from tallow.model_defs.parts import make_norm  # noqa: E402
from tallow.model_defs.quant_ops import QuantLinear  # noqa: E402

K, N = 512, 200  # N: no whole column tile of the GEMV / matmul schedules
FAST_TYPES = ["q4_0", "q4k"]
SLOW_TYPES = [t for t in QUANT_FORMATS if t not in FAST_TYPES]
# The functions a decoder exports, with the row shapes each passes to a projection.
SHAPES = {
    "decode": [1, 1, K],
    "batch_decode": ["b", 1, K],
    "prefill": [1, "s", K],
}
ROWS = {"decode": [1], "batch_decode": [1, 3, 7], "prefill": [1, 5, 37]}


def _prim_funcs(mod) -> dict:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def _kernel_of(scheduled, qtype: str, function: str) -> str:
    """The PrimFunc Relax function `function` calls for `qtype`'s projection."""
    called = re.findall(r"call_tir\((?:cls\.)?(\w+),", scheduled[function].script())
    (name,) = {n for n in called if n.startswith(f"quant_matmul_{qtype}")}
    return name


class _Projections(nn.Module):
    """One QuantLinear per format, called by each of the decoder's three functions."""

    def __init__(self, types):
        self.types = list(types)
        for qtype in types:
            setattr(self, qtype, QuantLinear(K, N, qtype))


for _function in SHAPES:
    setattr(
        _Projections,
        _function,
        lambda self, x: tuple(getattr(self, q)(x) for q in self.types),
    )


def _check_quant_matmuls(types):
    mod, _ = _Projections(types).export_tvm(
        {f: {"x": nn.spec.Tensor(shape, "float32")} for f, shape in SHAPES.items()}
    )
    scheduled, report = cuda_scheduled(mod)
    kernels = OpenCLKernels(_prim_funcs(scheduled))
    rng = np.random.default_rng(0)
    failures = []
    for qtype in types:
        x_full = rng.standard_normal((N, K)).astype(np.float32) * 0.7 + 0.1
        x_full[:, ::37] *= 4.0  # heavy tails: block scales and K-quant minimums exercised
        blocks = quantize(x_full, qtype)
        w = np.asarray(gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type))
        w = w.reshape(N, K).astype(np.float64)
        for function, rows in ROWS.items():
            name = _kernel_of(scheduled, qtype, function)
            for m in rows:
                x = rng.standard_normal((m, K)).astype(np.float32)
                out = np.full((m, N), np.nan, np.float32)
                sizes = {"b": m, "s": m}
                kernels.run(name, {"x": x, f"{qtype}_weight": blocks, "matmul": out}, sizes)
                ref = x.astype(np.float64) @ w.T
                bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-6
                err = np.abs(out - ref)
                if not (err <= bound).all():  # NaN (a row never written) fails too
                    rule = report["families"]
                    failures.append(f"{qtype} {function} rows={m} ({name}, {rule}): "
                                    f"max err {np.nanmax(err)}, unwritten {np.isnan(out).sum()}")
    assert not failures, "\n".join(failures)


def test_quant_matmuls_on_opencl():
    _check_quant_matmuls(FAST_TYPES)


@pytest.mark.slow
def test_quant_matmuls_on_opencl_every_format():
    _check_quant_matmuls(SLOW_TYPES)
