"""The compiled token sampler (`schedules/cpu/sampling.py`, `schedules/gpu/sampling.py`).

The oracle is the host sampler's numpy code (`keep_thresholds` and the inverse CDF behind
`sample_controls`), and for the draw itself the distribution `warp_logits` describes; the
kernels share no code with either. GPU kernels are compile-only here (no device).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tallow.runtime.model_runner_protocol import SamplingControls
from tallow.runtime.sampler import sample_controls, warp_logits
from tallow.runtime.sampling_params import SamplingParams

tvm = pytest.importorskip("tvm")

from tallow.schedules.cpu import sampling as cpu_sampling  # noqa: E402
from tallow.schedules.gpu import sampling as gpu_sampling  # noqa: E402


def _build(vocab: int):
    mod = tvm.IRModule({"sample": cpu_sampling.sample_kernel(vocab, vocab)})
    return tvm.compile(mod, target={"kind": "llvm"})["sample"]


def _run(kernel, logits: np.ndarray, c: SamplingControls) -> np.ndarray:
    n, vocab = logits.shape
    width = cpu_sampling.workspace_width(vocab)
    args = [
        logits,
        c.packed(),
        np.zeros(n, np.int32),
        np.zeros((n, width), np.float32),
        np.zeros((n, width), np.int32),
    ]
    tensors = [tvm.runtime.tensor(a) for a in args]
    kernel(*tensors)
    return tensors[2].numpy()


def _controls(rng, n: int, vocab: int) -> SamplingControls:
    return SamplingControls(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7], n).astype(np.float32),
        top_k=rng.choice([0, 1, 5, 40, vocab - 1, vocab], n).astype(np.int32),
        top_p=rng.choice([1.0, 0.95, 0.5, 0.1], n).astype(np.float32),
        min_p=rng.choice([0.0, 0.01, 0.2], n).astype(np.float32),
        uniform=rng.random(n).astype(np.float32),
    )


@pytest.mark.parametrize("vocab", [20, 1003, 4096])
def test_kernel_picks_the_host_samplers_tokens(vocab):
    """Every cut and the draw, on vocabularies below one vector, with a tail, and whole."""
    kernel = _build(vocab)
    rng = np.random.default_rng(vocab)
    for _ in range(12):
        n = 16
        logits = (rng.standard_normal((n, vocab)) * rng.uniform(0.5, 6)).astype(np.float32)
        logits[:, :5] = logits[:, 5:10]  # ties, also at the maximum
        c = _controls(rng, n, vocab)
        np.testing.assert_array_equal(_run(kernel, logits, c), sample_controls(logits, c))


def test_greedy_takes_the_first_maximum():
    vocab = 300
    kernel = _build(vocab)
    logits = np.zeros((3, vocab), np.float32)
    logits[0, [7, 100, 299]] = 5.0  # tied maxima: the first wins, as np.argmax
    logits[1, 290:] = 1.0  # the maximum only in the scalar tail
    logits[2, :] = -np.inf  # nothing finite: token 0, as np.argmax
    zeros = np.zeros(3, np.float32)
    c = SamplingControls(zeros, zeros.astype(np.int32), zeros + 1, zeros, zeros)
    assert _run(kernel, logits, c).tolist() == [7, 290, 0]


def test_draws_follow_the_warped_distribution():
    """One row drawn at a grid of uniforms: each token's share of the grid is its probability
    after temperature, top-k, top-p and min-p (softmax of `warp_logits`)."""
    vocab, n = 64, 4000
    kernel = _build(vocab)
    row = (np.random.default_rng(3).standard_normal(vocab) * 2).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)
    warped = warp_logits(row[None].astype(np.float64), [params])[0]
    prob = np.exp(warped - warped.max())
    prob /= prob.sum()
    c = SamplingControls(
        temperature=np.full(n, params.temperature, np.float32),
        top_k=np.full(n, params.top_k, np.int32),
        top_p=np.full(n, params.top_p, np.float32),
        min_p=np.full(n, params.min_p, np.float32),
        uniform=((np.arange(n) + 0.5) / n).astype(np.float32),
    )
    tokens = _run(kernel, np.repeat(row[None], n, axis=0), c)
    share = np.bincount(tokens, minlength=vocab) / n
    assert np.abs(share - prob).max() <= 1.5 / n
    assert set(np.flatnonzero(share)) == set(np.flatnonzero(prob))  # nothing cut is drawn


def test_function_is_added_to_the_module():
    from tvm import relax

    from tallow.compiler.backends import get_backend
    from tallow.compiler.sampler_function import SAMPLER_FUNCTION, add_sampler_function

    mod = add_sampler_function(tvm.IRModule(), 1000, get_backend("cpu"))
    func = mod[SAMPLER_FUNCTION]
    assert isinstance(func, relax.Function)
    assert [p.name for p in func.params] == ["logits", "controls"]
    assert [str(p.ty) for p in func.params][1].startswith("R.Tensor((n, 5)")


@pytest.mark.parametrize("kind", ["cuda", "metal"])
def test_gpu_kernel_builds(kind):
    if kind == "cuda" and shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from tallow.compiler.cuda_build import nvcc_callback

    mod = tvm.IRModule({"sample": gpu_sampling.sample_kernel(1003, 1003)})
    target = tvm.target.Target({"kind": kind, **({"arch": "sm_80"} if kind == "cuda" else {})})
    # nvcc as tallow's CUDA builds use it: TVM's own hook in a fresh process asks for NVRTC
    # (the cuda-bindings package), which a CPU machine does not have
    with nvcc_callback([80]), tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        built = tvm.tirx.build(mod, tvm.target.Target(target, host={"kind": "llvm"}))
    source = built.imports[0].inspect_source()
    barrier = "__syncthreads()" if kind == "cuda" else "threadgroup_barrier"
    # one block per row, tree reductions over shared memory with barriers between levels
    assert source.count(barrier) > 3 * gpu_sampling.LOG_THREADS
