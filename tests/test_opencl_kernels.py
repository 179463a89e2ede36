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
from opencl_runner import OpenCLKernels, gpu_scheduled, unavailable

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
ROWS = {"decode": [1], "batch_decode": [1, 3, 7, 16, 64], "prefill": [1, 5, 37]}


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


def _check_quant_matmuls(types, shapes=SHAPES, rows=ROWS, dtype="float32"):
    mod, _ = _Projections(types).export_tvm(
        {f: {"x": nn.spec.Tensor(shape, dtype)} for f, shape in shapes.items()}
    )
    scheduled, report = gpu_scheduled(mod, {"float32": "f32", "float16": "f16"}[dtype])
    kernels = OpenCLKernels(_prim_funcs(scheduled))
    rng = np.random.default_rng(0)
    failures = []
    for qtype in types:
        x_full = rng.standard_normal((N, K)).astype(np.float32) * 0.7 + 0.1
        x_full[:, ::37] *= 4.0  # heavy tails: block scales and K-quant minimums exercised
        blocks = quantize(x_full, qtype)
        w = np.asarray(gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type))
        w = w.reshape(N, K).astype(np.float64)
        for function, counts in rows.items():
            name = _kernel_of(scheduled, qtype, function)
            for m in counts:
                x = rng.standard_normal((m, K)).astype(dtype)
                out = np.full((m, N), np.nan, np.float32)
                sizes = {"b": m, "s": m}
                kernels.run(name, {"x": x, f"{qtype}_weight": blocks, "matmul": out}, sizes)
                ref = x.astype(np.float64) @ w.T
                bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-6
                err = np.abs(out - ref)
                if not (err <= bound).all():  # NaN (a row never written) fails too
                    rule = report["families"]
                    failures.append(
                        f"{qtype} {function} rows={m} ({name}, {rule}): "
                        f"max err {np.nanmax(err)}, unwritten {np.isnan(out).sum()}"
                    )
    assert not failures, "\n".join(failures)


def test_quant_matmuls_on_opencl():
    _check_quant_matmuls(FAST_TYPES)


def test_static_row_decode_on_opencl():
    """`QuantDecodeGEMV` at its largest static row count: 64 rows of register accumulators per
    lane, summed across the lanes row by row (the lanes bound innermost, not the rows)."""
    _check_quant_matmuls(["q4k"], {"decode": [64, 1, K]}, {"decode": [64]})


def test_f16_decode_on_opencl():
    """The f16 `decode` (`QuantDecodeGEMV`) and `batch_decode` (dlight `LowBatchGEMV`) kernels
    with f16 activations: PoCL has no cl_khr_fp16, but these kernels only load the f16 inputs
    and convert them to float (`vload_half`, core OpenCL; `opencl_runner.py`), then decode and
    accumulate in f32, so their f16 numerics run as they would on a GPU. (dlight's prefill
    kernels keep f16 values in buffers of their own, which the runner refuses on PoCL.)"""
    _check_quant_matmuls(
        ["q4k"],
        {"decode": [1, 1, K], "batch_decode": ["b", 1, K]},
        {"decode": [1], "batch_decode": [1, 3, 16]},
        "float16",
    )


@pytest.mark.slow
def test_quant_matmuls_on_opencl_every_format():
    _check_quant_matmuls(SLOW_TYPES)


# --- batch invariance (`--deterministic`) --------------------------------------------------
class _BatchDecode(nn.Module):
    """`batch_decode`'s kernels that reduce a row: quantized matmuls, in f32 a float matmul
    and RMSNorm (f16 ones compute in f16, which PoCL cannot run)."""

    def __init__(self, dtype: str):
        self.f32 = dtype == "float32"
        for qtype in FAST_TYPES:
            setattr(self, qtype, QuantLinear(K, N, qtype))
        self.dense = nn.Linear(K, N, bias=False)
        self.norm = make_norm(K, 1e-5, 0.0, "float32")

    def batch_decode(self, x):
        quant = tuple(getattr(self, q)(x) for q in FAST_TYPES)
        return (*quant, self.dense(x), self.norm(x)) if self.f32 else quant


@pytest.mark.parametrize(
    ("target", "dtype"),
    [("cuda", "float32"), ("cuda", "float16"), ("metal", "float32"), ("metal", "float16")],
)
def test_batch_decode_rows_do_not_depend_on_the_batch(target, dtype):
    """`--deterministic` on a GPU library (docs/cpu-kernels.md#deterministic-mode): `batch_decode`'s
    kernels as `target` schedules them (dlight `LowBatchGEMV` for the matmuls: 4-row tiles on
    `blockIdx.y`, K split across the threads; `Reduction` for RMSNorm) give row r of a batch
    of B, for B from 1 to 17, the bits of row r alone. Run as OpenCL C: CUDA's warp-shuffle
    and Metal's simdgroup reductions lower to shared memory here (`opencl_runner.py`)."""
    mod, _ = _BatchDecode(dtype).export_tvm(
        {"batch_decode": {"x": nn.spec.Tensor(["b", 1, K], dtype)}}
    )
    scheduled, _ = gpu_scheduled(mod, {"float32": "f32", "float16": "f16"}[dtype], target=target)
    funcs = _prim_funcs(scheduled)
    kernels = OpenCLKernels(funcs)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((17, 1, K)).astype(dtype)
    differ = []
    for name in funcs:
        (buffers,) = {tuple(k.buffers) for k in kernels.kernels[name]}
        arrays = {}
        for buf, buf_dtype in buffers:
            if buf.endswith("_weight"):
                qtype = buf.removesuffix("_weight")
                w = rng.standard_normal((N, K) if qtype != "norm" else K).astype(np.float32)
                arrays[buf] = quantize(w, qtype) if qtype in FAST_TYPES else w.astype(buf_dtype)
        ((out, out_dtype),) = [(b, d) for b, d in buffers if b != "x" and b not in arrays]

        def run(rows, arrays=arrays, name=name, out=out, out_dtype=out_dtype):
            result = np.full((len(rows), 1, N if "norm" not in name else K), np.nan, out_dtype)
            kernels.run(name, {**arrays, "x": rows, out: result}, {"b": len(rows)})
            return result.view(np.uint32)

        alone = np.concatenate([run(x[r : r + 1]) for r in range(17)])
        differ += [
            f"{name} at {b}" for b in range(1, 18) if not np.array_equal(run(x[:b]), alone[:b])
        ]
        assert not np.isnan(alone.view(np.float32)).any(), f"{name}: rows never written"
    assert not differ, differ


# --- RMSNorm (Llama style, and Gemma's `1 + w` in float32) --------------------------------
HIDDEN = 576  # SmolLM2's width: not a power of two


class _Norms(nn.Module):
    def __init__(self):
        self.llama = make_norm(HIDDEN, 1e-5, 0.0, "float32")
        self.gemma = make_norm(HIDDEN, 1e-6, 1.0, "float32")

    def decode(self, x):
        return self.llama(x), self.gemma(x)

    def prefill(self, x):
        return self.llama(x), self.gemma(x)


def test_rms_norms_on_opencl():
    mod, _ = _Norms().export_tvm(
        {
            "decode": {"x": nn.spec.Tensor(["b", 1, HIDDEN], "float32")},
            "prefill": {"x": nn.spec.Tensor([1, "s", HIDDEN], "float32")},
        }
    )
    scheduled, report = gpu_scheduled(mod)
    assert set(report["rules"]) == {"Reduction"}, report["rules"]
    kernels = OpenCLKernels(_prim_funcs(scheduled))
    rng = np.random.default_rng(1)
    for norm, eps, offset, out_name in (
        ("llama", 1e-5, 0.0, "T_cast"),
        ("gemma", 1e-6, 1.0, "rms_norm_offset"),
    ):
        w = rng.standard_normal(HIDDEN).astype(np.float32) * 0.2
        for function in ("decode", "prefill"):
            called = re.findall(r"call_tir\((?:cls\.)?(\w+),", scheduled[function].script())
            (name,) = [
                n
                for n in called
                if n.startswith("rms_norm_offset" if offset else "rms_norm")
                and (offset or not n.startswith("rms_norm_offset"))
            ]
            for rows in (1, 5, 33):
                x = (rng.standard_normal((rows, HIDDEN)) * 3).astype(np.float32)
                out = np.full_like(x, np.nan)
                arrays = {"x": x, f"{norm}_weight": w, out_name: out}
                kernels.run(name, arrays, {"b": rows, "s": rows})
                x64 = x.astype(np.float64)
                ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps) * (offset + w)
                np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6, err_msg=f"{name} {rows}")


# --- the GPU token sampler (schedules/gpu/sampling.py, scheduled by hand) ------------------
@pytest.mark.parametrize("vocab", [1003, pytest.param(4096, marks=pytest.mark.slow)])
def test_gpu_sampler_on_opencl(vocab):
    """Sampled rows only: PoCL 3.1 loses the greedy branch's token write (barriers inside a
    uniform if/else; its "repl" work-group method gets it right but compiles this kernel for
    minutes), so temperature 0 is not checked here (docs/gpu-artifacts.md)."""
    from tallow.runtime.model_runner_protocol import SamplingControls
    from tallow.runtime.sampler import sample_controls
    from tallow.schedules.gpu import sampling

    kernels = OpenCLKernels({"sample": sampling.sample_kernel(vocab, vocab)})
    width = sampling.workspace_width(vocab)
    rng = np.random.default_rng(vocab)
    n = 24
    logits = (rng.standard_normal((n, vocab)) * rng.uniform(0.5, 6, (n, 1))).astype(np.float32)
    logits[:, :5] = logits[:, 5:10]  # ties, also at the maximum
    c = SamplingControls(
        temperature=rng.choice([0.5, 1.0, 1.7], n).astype(np.float32),
        top_k=rng.choice([0, 1, 5, 40, vocab - 1, vocab], n).astype(np.int32),
        top_p=rng.choice([1.0, 0.95, 0.5, 0.1], n).astype(np.float32),
        min_p=rng.choice([0.0, 0.01, 0.2], n).astype(np.float32),
        uniform=rng.random(n).astype(np.float32),
    )
    token = np.full(n, -1, np.int32)
    arrays = {
        "x": logits,
        "controls": c.packed(),
        "token": token,
        "weights": np.zeros((n, width), np.float32),
        "keys": np.zeros((n, width), np.int32),
    }
    kernels.run("sample", arrays, {"n": n})
    np.testing.assert_array_equal(token, sample_controls(logits, c))
