"""The GPU-scheduled kernel cases, shared by the PoCL test (`test_opencl_kernels.py`: wide
shapes, numerics) and the Oclgrind test (`test_oclgrind.py`: small shapes, every access
checked), so both run the same kernels against the same oracles.

Each `check_*` schedules its kernels as a GPU backend does, launches them through a runner
(`runner=`: `opencl_runner.OpenCLKernels` on whichever OpenCL device the process sees, PoCL
or Oclgrind's simulated device under `oclgrind`; or `wgpu_runner.WGPUKernels` on a Vulkan
device, with f16 buffers) and compares with numpy. `small_cases(runner, dtype)` is the one
list of small instances: `OCLGRIND_CASES` (f32; `tests/oclgrind_harness.py` runs them by
name under `oclgrind`) and the wgpu test's f16 cases (`test_wgpu_kernels.py`).

f16 tolerances (`F16_ULP`, 2**-11: the unit roundoff of round-to-nearest f16): the inputs
are f16 values and the oracle computes from those same values in float64, so only what the
kernel rounds counts: a weight dequantized to f16 (|dw| <= 2**-11 |w|), an f16 result
(<= 2**-11 |y|, plus half the smallest subnormal, 2**-25), and f32 accumulation as in f32.
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import tvm
from opencl_moe import check_moe
from opencl_paged_kv import check_merge_state, check_paged_kv_attention
from opencl_runner import F16_TINY, F16_ULP, OpenCLKernels, gpu_scheduled
from tvm.relax.frontend import nn

from tallow.compiler.quant import QUANT_FORMATS, quantize
from tallow.model_defs.parts import make_norm
from tallow.model_defs.quant_ops import QuantLinear

K, N = 512, 200  # N: no whole column tile of the GEMV / matmul schedules
FAST_TYPES = ["q4_0", "q4k"]
# The decoder's functions, with the leading dimensions of the rows each passes a projection.
LEADING = {"decode": [1, 1], "batch_decode": ["b", 1], "prefill": [1, "s"]}
ROWS = {"decode": [1], "batch_decode": [1, 3, 7, 16, 64], "prefill": [1, 5, 37]}
_DTYPES = {"float32": "f32", "float16": "f16"}


def prim_funcs(mod) -> dict:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def _called(scheduled, function: str) -> list[str]:
    return re.findall(r"call_tir\((?:cls\.)?(\w+),", scheduled[function].script())


# --- quantized matmuls: decode GEMV, batched decode, prefill -------------------------------
class _Projections(nn.Module):
    """One QuantLinear per format, called by each of the decoder's functions."""

    def __init__(self, types, k: int, n: int, out_dtype: str = "float32"):
        self.types = list(types)
        for qtype in types:
            setattr(self, qtype, QuantLinear(k, n, qtype, out_dtype))


for _function in LEADING:
    setattr(_Projections, _function, lambda self, x: tuple(getattr(self, q)(x) for q in self.types))


def check_quant_matmuls(
    types, rows=ROWS, dtype="float32", k=K, n=N, leading=LEADING, runner=OpenCLKernels, half=False
):
    """Each format's projection as each function in `rows` calls it, at each row count,
    against the `gguf` dequantizer + numpy (within f32 rounding of |x| @ |w|). `half`: f16
    weights and results too, as an f16 model's projections (`projections.py`) are: within
    f16 rounding of each weight and of the result (`F16_ULP`), f32 rounding of the sum."""
    out_dtype = dtype if half else "float32"
    mod, _ = _Projections(types, k, n, out_dtype).export_tvm(
        {f: {"x": nn.spec.Tensor([*leading[f], k], dtype)} for f in rows}
    )
    scheduled, report = gpu_scheduled(mod, _DTYPES[dtype])
    kernels = runner(prim_funcs(scheduled))
    rng = np.random.default_rng(0)
    failures = []
    for qtype in types:
        x_full = rng.standard_normal((n, k)).astype(np.float32) * 0.7 + 0.1
        x_full[:, ::37] *= 4.0  # heavy tails: block scales and K-quant minimums exercised
        blocks = quantize(x_full, qtype)
        w = np.asarray(gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type))
        w = w.reshape(n, k).astype(np.float64)
        for function, counts in rows.items():
            called = _called(scheduled, function)
            (name,) = {c for c in called if c.startswith(f"quant_matmul_{qtype}")}
            for m in counts:
                x = rng.standard_normal((m, k)).astype(dtype)
                out = np.full((m, n), np.nan, out_dtype)
                arrays = {"x": x, f"{qtype}_weight": blocks, ("cast" if half else "matmul"): out}
                kernels.run(name, arrays, {"b": m, "s": m})
                ref = x.astype(np.float64) @ w.T
                scale = np.abs(x).astype(np.float64) @ np.abs(w).T
                bound = 1e-5 * scale + 1e-6
                if half:  # weights rounded to f16, then the f32 sum rounded to f16
                    bound += F16_ULP * (scale + np.abs(ref) + bound) + F16_TINY
                err = np.abs(out - ref)
                if not (err <= bound).all():  # NaN (a row never written) fails too
                    failures.append(
                        f"{qtype} {function} rows={m} ({name}, {report['families']}): "
                        f"max err {np.nanmax(err)}, unwritten {np.isnan(out).sum()}"
                    )
    assert not failures, "\n".join(failures)


# --- batch invariance (`--deterministic`) --------------------------------------------------
class _BatchDecode(nn.Module):
    """`batch_decode`'s kernels that reduce a row: quantized matmuls, in f32 a float matmul
    and RMSNorm (f16 ones compute in f16, which PoCL and Oclgrind cannot run)."""

    def __init__(self, dtype: str, k: int, n: int, half: bool):
        self.all = dtype == "float32" or half
        out = dtype if half else "float32"
        for qtype in FAST_TYPES:
            setattr(self, qtype, QuantLinear(k, n, qtype, out))
        self.dense = nn.Linear(k, n, bias=False, dtype=out)
        self.norm = make_norm(k, 1e-5, 0.0, out)

    def batch_decode(self, x):
        quant = tuple(getattr(self, q)(x) for q in FAST_TYPES)
        return (*quant, self.dense(x), self.norm(x)) if self.all else quant


def check_batch_invariance(
    target: str,
    dtype: str,
    batch: int = 17,
    k: int = K,
    n: int = N,
    runner=OpenCLKernels,
    half: bool = False,
):
    """Row r of a batch of B, for B from 1 to `batch`, has the bits of row r run alone.
    `half`: an f16 model's kernels (f16 weights, results, dense matmul and RMSNorm)."""
    mod, _ = _BatchDecode(dtype, k, n, half).export_tvm(
        {"batch_decode": {"x": nn.spec.Tensor(["b", 1, k], dtype)}}
    )
    scheduled, _ = gpu_scheduled(mod, _DTYPES[dtype], target=target)
    funcs = prim_funcs(scheduled)
    kernels = runner(funcs)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((batch, 1, k)).astype(dtype)
    differ = []
    for name in funcs:
        (buffers,) = {tuple(kn.buffers) for kn in kernels.kernels[name]}
        arrays = {}
        for buf, buf_dtype in buffers:
            if buf.endswith("_weight"):
                qtype = buf.removesuffix("_weight")
                w = rng.standard_normal((n, k) if qtype != "norm" else k).astype(np.float32)
                arrays[buf] = quantize(w, qtype) if qtype in FAST_TYPES else w.astype(buf_dtype)
        ((out, out_dtype),) = [(b, d) for b, d in buffers if b != "x" and b not in arrays]

        def run(rows, arrays=arrays, name=name, out=out, out_dtype=out_dtype):
            result = np.full((len(rows), 1, n if "norm" not in name else k), np.nan, out_dtype)
            kernels.run(name, {**arrays, "x": rows, out: result}, {"b": len(rows)})
            return result

        alone = np.concatenate([run(x[r : r + 1]) for r in range(batch)])
        bits = f"u{alone.itemsize}"  # compared bit for bit
        differ += [
            f"{name} at {b}"
            for b in range(1, batch + 1)
            if not np.array_equal(run(x[:b]).view(bits), alone[:b].view(bits))
        ]
        assert not np.isnan(alone).any(), f"{name}: rows never written"
    assert not differ, differ


# --- RMSNorm (Llama style, and Gemma's `1 + w` in float32) --------------------------------
class _Norms(nn.Module):
    def __init__(self, hidden: int, dtype: str):
        self.llama = make_norm(hidden, 1e-5, 0.0, dtype)
        self.gemma = make_norm(hidden, 1e-6, 1.0, dtype)

    def decode(self, x):
        return self.llama(x), self.gemma(x)

    def prefill(self, x):
        return self.llama(x), self.gemma(x)


def check_rms_norms(hidden: int = 576, rows=(1, 5, 33), dtype="float32", runner=OpenCLKernels):
    """Both norms as `decode` and `prefill` call them (the dlight `Reduction` rule). In f16
    both square and sum in f32 (TVM's `rms_norm`, tallow's Gemma norm), then round once."""
    mod, _ = _Norms(hidden, dtype).export_tvm(
        {
            "decode": {"x": nn.spec.Tensor(["b", 1, hidden], dtype)},
            "prefill": {"x": nn.spec.Tensor([1, "s", hidden], dtype)},
        }
    )
    scheduled, report = gpu_scheduled(mod, _DTYPES[dtype])
    assert set(report["rules"]) == {"Reduction"}, report["rules"]
    kernels = runner(prim_funcs(scheduled))
    rng = np.random.default_rng(1)
    rtol = 2e-5 + (F16_ULP if dtype == "float16" else 0)
    for norm, eps, offset in (("llama", 1e-5, 0.0), ("gemma", 1e-6, 1.0)):
        w = (rng.standard_normal(hidden) * 0.2).astype(dtype)
        for function in ("decode", "prefill"):
            (name,) = [
                c
                for c in _called(scheduled, function)
                if c.startswith("rms_norm_offset" if offset else "rms_norm")
                and (offset or not c.startswith("rms_norm_offset"))
            ]
            (buffers,) = {tuple(kn.buffers) for kn in kernels.kernels[name]}
            (out_name,) = [b for b, _ in buffers if b not in ("x", f"{norm}_weight")]
            for m in rows:
                x = (rng.standard_normal((m, hidden)) * 3).astype(dtype)
                out = np.full_like(x, np.nan)
                kernels.run(name, {"x": x, f"{norm}_weight": w, out_name: out}, {"b": m, "s": m})
                x64 = x.astype(np.float64)
                scale = offset + w.astype(np.float64)  # (numpy would add in f16)
                ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps) * scale
                np.testing.assert_allclose(out, ref, rtol=rtol, atol=2e-6, err_msg=f"{name} {m}")


# --- the GPU token sampler (schedules/gpu/sampling.py, scheduled by hand) ------------------
def check_sampler(vocab: int = 1003, n: int = 24, greedy: int = 0, runner=OpenCLKernels):
    """`n` sampled rows (top-k, top-p, min-p, the draw), then `greedy` rows at temperature 0.
    PoCL 3.1 loses the greedy branch's token write (barriers inside a uniform if/else; its
    "repl" work-group method gets it right but compiles this kernel for minutes), so the
    PoCL test has none; Oclgrind runs them right (docs/gpu-artifacts.md)."""
    from tallow.runtime.model_runner_protocol import SamplingControls
    from tallow.runtime.sampler import sample_controls
    from tallow.schedules.gpu import sampling

    kernels = runner({"sample": sampling.sample_kernel(vocab, vocab)})
    width = sampling.workspace_width(vocab)
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((n, vocab)) * rng.uniform(0.5, 6, (n, 1))).astype(np.float32)
    logits[:, :5] = logits[:, 5:10]  # ties, also at the maximum
    fields = {
        "temperature": rng.choice([0.5, 1.0, 1.7], n).astype(np.float32),
        "top_k": rng.choice([0, 1, 5, 40, vocab - 1, vocab], n).astype(np.int32),
        "top_p": rng.choice([1.0, 0.95, 0.5, 0.1], n).astype(np.float32),
        "min_p": rng.choice([0.0, 0.01, 0.2], n).astype(np.float32),
        "uniform": rng.random(n).astype(np.float32),
    }
    if greedy:  # after the sampled rows, whose draws stay as they were
        logits = np.concatenate([logits, logits[:greedy] * 1.3])
        fields = {k: np.concatenate([v, v[:greedy]]) for k, v in fields.items()}
        fields["temperature"][n:] = 0.0
        n += greedy
    c = SamplingControls(**fields)
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


# --- RoPE from a frequency table, in the graph (partial rotary: Phi-4-mini's kind) ---------
class _Rope(nn.Module):
    def __init__(self, table):
        self.table = table

    def decode(self, x, positions):
        return self.table(x, positions)

    def prefill(self, x, positions):
        return self.table(x, positions)


def check_rope(
    heads: int = 4,
    head_dim: int = 64,
    rotary: int = 48,
    tokens=(1, 7, 33),
    dtype="float32",
    runner=OpenCLKernels,
):
    """`model_defs/rope.py`'s rotation, as the GPU backend schedules it, over `rotary` of
    `head_dim` dimensions (the rest pass through), against numpy. The rotation computes in
    f32; an f16 result is rounded once more (`F16_ULP`)."""
    from tallow.model_defs.rope import RopeTable, inverse_frequencies

    inv_freq = inverse_frequencies(10000.0, rotary)
    spec = {
        "x": nn.spec.Tensor(["t", heads, head_dim], dtype),
        "positions": nn.spec.Tensor(["t"], "int32"),
    }
    mod, _ = _Rope(RopeTable(inv_freq, 1.1)).export_tvm({"decode": spec, "prefill": spec})
    scheduled, _ = gpu_scheduled(mod, _DTYPES[dtype])
    funcs = prim_funcs(scheduled)
    kernels = runner(funcs)
    rtol = F16_ULP if dtype == "float16" else 0
    rng = np.random.default_rng(2)
    half = rotary // 2
    for name in funcs:
        (buffers,) = {tuple(kn.buffers) for kn in kernels.kernels[name]}
        for t in tokens:
            x = rng.standard_normal((t, heads, head_dim)).astype(dtype)
            pos = rng.integers(0, 4096, t).astype(np.int32)
            angle = pos[:, None].astype(np.float64) * inv_freq[None, :].astype(np.float64)
            cos, sin = np.cos(angle)[:, None] * 1.1, np.sin(angle)[:, None] * 1.1
            ref = x.astype(np.float64).copy()
            a, b = ref[..., :half].copy(), ref[..., half:rotary].copy()
            ref[..., :half] = a * cos - b * sin
            ref[..., half:rotary] = b * cos + a * sin
            arrays = {}
            for buf, dtype in buffers:  # x, positions, the frequency table, the output
                if dtype == "int32":
                    arrays[buf] = pos
                elif buf == "x":
                    arrays[buf] = x
                elif buf.startswith("rope_table") or buf.startswith("T_"):
                    arrays[buf] = np.full_like(x, np.nan)
                else:  # the frequency table (float32 in every model dtype)
                    arrays[buf] = inv_freq
            out = next(v for k, v in arrays.items() if v.shape == x.shape and k != "x")
            kernels.run(name, arrays, {"t": t})
            # angles up to 4096 rad in f32: cos/sin within a few 1e-4 of float64's
            np.testing.assert_allclose(out, ref, rtol=rtol, atol=2e-3, err_msg=f"{name} {t}")


# --- the small instances Oclgrind runs (5 to 25 s each on an idle core) -------------------
# One quant format per family (legacy 32-blocks, K-quants, i-quants); K = 256, one K-quant
# block; N = 24, no whole column tile (the PoCL test's 200 costs 8x under Oclgrind); the
# decode GEMV at 1 row and its static 64-row form, batched decode at 1, 5 and 64 rows,
# prefill at 37 (a partial row tile). Every format at wider shapes and rows 1..64:
# benchmarks/oclgrind_sweep.py.
SMALL = {"k": 256, "n": 24}
QUANT_ROWS = {"decode": [1], "batch_decode": [1, 5, 64], "prefill": [37]}


def small_cases(runner=OpenCLKernels, dtype: str = "float32") -> dict:
    """The small instances by name, run with `runner` at the model dtype `dtype`: f32 for
    the OpenCL devices; f16 (buffers, weights and results as an f16 model has them) for
    wgpu. In f16 the quantized matmuls' prefill keeps N = 24: no static extent above 64, so
    the CUDA rules keep it on SIMT cores (dlight `Matmul`), which WGSL can spell; wmma
    tensor-core tiles (every extent above 64) have no WGSL form."""
    half = dtype == "float16"
    quant = {"k": SMALL["k"], "n": SMALL["n"], "runner": runner, "half": half}
    return {
        **{
            f"quant_{qtype}": (lambda q=qtype: check_quant_matmuls([q], QUANT_ROWS, dtype, **quant))
            for qtype in ("q4_0", "q4k", "iq4_xs")
        },
        "decode_static_64": lambda: check_quant_matmuls(
            ["q6k"], {"decode": [64]}, dtype, leading={"decode": [64, 1]}, **quant
        ),
        **{
            f"batch_invariance_{target}": (
                lambda t=target: check_batch_invariance(
                    t, dtype, 4, runner=runner, half=half, **SMALL
                )
            )
            for target in ("cuda", "metal")
        },
        "rms_norms": lambda: check_rms_norms(rows=(1, 5), dtype=dtype, runner=runner),
        "rope": lambda: check_rope(tokens=(1, 7), dtype=dtype, runner=runner),
        "moe": lambda: check_moe(dtype=dtype, runner=runner),
        # vocab 1003, 24 rows: the size that showed the race; 4 greedy rows after them. The
        # sampler reads f32 logits in every model dtype.
        "sampler": lambda: check_sampler(greedy=4, runner=runner),
    }


OCLGRIND_CASES = {
    **small_cases(),
    "f16_decode": lambda: check_quant_matmuls(
        ["q8_0"], {"decode": [1], "batch_decode": [3]}, "float16", **SMALL
    ),
    "paged_kv_attention": lambda: check_paged_kv_attention(kv_lens=(1, 17, 40), q_lens=(1, 5, 9)),
    # tallow's merge in place of TVM's racing one: 6 heads (a block's 4, then 2 and 2 idle),
    # 80 dims (lanes past D idle on the third stride)
    "merge_state": lambda: check_merge_state(n=3, h_q=6, d=80),
}
# Findings in kernels tallow does not own (TVM's), kept as tests that expect them so a TVM
# upgrade that fixes one shows up: case -> the report expected.
KNOWN_FINDINGS = {
    "tvm_merge_state": (
        lambda: check_merge_state(compare=False, kernel="merge"),
        "Read-write data race at global memory",
    ),
}
