"""Vectorisable math on the CPU: `schedules/tir_common.py`, `compiler/fast_silu_pass.py`, and
the elementwise schedule of `schedules/cpu/rules.py`. The oracle is numpy in float64."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.relax.frontend import nn

from tallow.compiler.fast_silu_pass import fast_silu
from tallow.compiler.target import resolve_target
from tallow.schedules import tir_common
from tallow.schedules.cpu.rules import schedule_module

TARGET = resolve_target("cpu", "f32").tvm()


def _elementwise(fn, x: np.ndarray) -> np.ndarray:
    a = te.placeholder(x.shape, "float32", name="a")
    out = te.compute(x.shape, lambda i: fn(a[i]), name="out")
    func = te.create_prim_func([a, out]).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), TARGET)
    result = tvm.runtime.empty(x.shape, "float32")
    lib["main"](tvm.runtime.tensor(x), result)
    return result.numpy().astype(np.float64)


def test_exp2_and_sigmoid_match_numpy():
    x = np.concatenate(
        [np.linspace(-30, 30, 4001), [-200.0, -126.0, -0.5, 0.0, 1e-8, 0.5, 126.0]]
    ).astype(np.float32)
    xd = x.astype(np.float64)
    got = _elementwise(tir_common.exp2, np.minimum(x, 0))
    ref = np.exp2(np.maximum(np.minimum(xd, 0), -126))
    assert np.all(np.abs(got - ref) <= 4e-7 * ref)
    got = _elementwise(tir_common.sigmoid, x)
    ref = 1 / (1 + np.exp(-xd))
    small = np.abs(xd) <= 10
    assert np.all(np.abs(got - ref)[small] <= 6e-7 * ref[small])
    assert np.all(np.abs(got - ref)[~small] <= 2e-6 * ref[~small] + 1e-38)
    assert got[x == 0.0][0] == 0.5


def _silu_module():
    bb = relax.BlockBuilder()
    rows = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([rows, 1, 96], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, 2, axis=-1))
            gate = bb.emit(relax.TupleGetItem(parts, 0))
            up = bb.emit(relax.TupleGetItem(parts, 1))
            out = bb.emit_output(relax.op.multiply(relax.op.nn.silu(gate), up))
        bb.emit_func_output(out)
    return bb.get()


def _lower(mod):
    from tvm.relax import transform as T

    passes = [T.LegalizeOps(), T.AnnotateTIROpPattern(), T.FuseOps(), T.FuseTIR()]
    with TARGET:
        return schedule_module(tvm.transform.Sequential(passes)(mod), TARGET)


def test_fast_silu_replaces_libm_and_matches_numpy():
    mod = fast_silu()(_silu_module())
    assert "R.nn.silu" not in mod.script()
    lowered = _lower(mod)
    (kernel,) = [f for _, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)]
    text = kernel.script()
    assert "T.sigmoid" not in text and "T.exp" not in text
    # the elementwise schedule: rows on the thread pool, the last axis in vectors
    assert "T.parallel" in text and "T.vectorized" in text
    vm = relax.VirtualMachine(tvm.compile(lowered, TARGET), tvm.cpu())
    rng = np.random.default_rng(0)
    for rows in (1, 5):
        x = (rng.standard_normal((rows, 1, 96)) * 8).astype(np.float32)
        x[0, 0, :6] = [-200.0, -90.0, -20.0, 0.0, 20.0, 200.0]
        got = vm["main"](tvm.runtime.tensor(x)).numpy().astype(np.float64)
        g, u = x[..., :48].astype(np.float64), x[..., 48:].astype(np.float64)
        ref = g / (1 + np.exp(-g)) * u
        assert np.all(np.abs(got - ref) <= 5e-6 * np.abs(ref) + 1e-30)


def test_fast_silu_leaves_other_dtypes():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4, 8], "float16"))
    with bb.function("main", [x]):
        out = bb.emit(relax.op.nn.silu(x))
        bb.emit_func_output(out)
    assert "R.nn.silu" in fast_silu()(bb.get()).script()


class _Norm(nn.Module):
    def __init__(self, dim: int):
        self.norm = nn.RMSNorm(dim, -1, 1e-5, bias=False)

    def forward(self, x):
        return self.norm(x)


def test_rms_norm_is_vectorised_and_matches_numpy():
    """The row-norm schedule (`schedules/cpu/norm.py`): a hidden-state norm ([b, 1, 576])
    and a per-head one ([b, s, heads, 128], as Qwen3's q/k norms)."""
    rng = np.random.default_rng(3)
    for shape, spec in (
        ((16, 1, 576), ["b", 1, 576]),
        ((2, 3, 4, 128), ["b", "s", 4, 128]),
    ):
        module = _Norm(shape[-1])
        mod, params = module.export_tvm({"forward": {"x": nn.spec.Tensor(spec, "float32")}})
        lowered = _lower(mod)
        (kernel,) = [f for _, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)]
        text = kernel.script()
        assert "T.vectorized" in text and "_rf" in text  # vector partial sums of the squares
        vm = relax.VirtualMachine(tvm.compile(lowered, TARGET), tvm.cpu())
        weight = rng.standard_normal(shape[-1]).astype(np.float32)
        for rows in (1, shape[0]):
            x = (rng.standard_normal((rows, *shape[1:])) * 3).astype(np.float32)
            x[0, ..., :7] = [0.0, 1e-3, -50.0, 50.0, 0.0, 1.0, -1.0]
            got = vm["forward"](tvm.runtime.tensor(x), tvm.runtime.tensor(weight)).numpy()
            xd = x.astype(np.float64)
            ref = xd / np.sqrt((xd**2).mean(axis=-1, keepdims=True) + 1e-5) * weight
            assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()
