"""Dequantizing kernels for GGUF block formats (tallow.model_defs.quant_ops, schedules.cpu.quant).

* TIR dequantization of every type equals ``gguf.quants.dequantize`` bit for bit (float32).
* QuantLinear (x @ dequantize(W)^T) compiles to ONE PrimFunc holding the "dequantize" block
  after the Relax fusion pipeline, our CPU schedule keeps W out of global memory, and the
  result matches numpy (gguf dequantize, then matmul) for M in {1, 3, 17} (not multiples of
  the row tile) and several N, K.
* QuantEmbedding returns exactly the dequantized rows it looks up.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import tvm
from quant_blocks import weight_blocks
from tvm import relax, s_tir, te
from tvm.relax.frontend import nn
from tvm.target import Target

from tallow.compiler.quant import QUANT_FORMATS
from tallow.compiler.relax_pipeline import fusion_passes, vm_lowering_passes
from tallow.model_defs.quant_ops import (
    QuantEmbedding,
    QuantLinear,
    dequantize_te,
    row_bytes,
)
from tallow.schedules.cpu import quant as cpu_quant

TYPES = list(QUANT_FORMATS)
TARGET = Target({"kind": "llvm"})


def _blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # heavy-ish tails and an offset so q4_1/q5_1 minimums and K-quant mins are exercised
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.7 + 0.1
    x[:, ::37] *= 4.0
    return weight_blocks(x, qtype, seed)


def _gguf_dequant(blocks: np.ndarray, qtype: str, rows: int, cols: int) -> np.ndarray:
    out = gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type)
    return np.asarray(out, dtype=np.float32).reshape(rows, cols)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_bit_exact(qtype):
    rows, cols = 5, 512
    b = _blocks(qtype, rows, cols, seed=1)
    w = te.placeholder((rows, row_bytes(qtype, cols)), "uint8", name="w")
    table = QUANT_FORMATS[qtype].table  # a lattice i-quant's grid: one more input
    inputs = [b] if table is None else [b, table()]
    tt = [w] if table is None else [w, te.placeholder(table().shape, "uint8", name="table")]
    deq = dequantize_te(w, qtype, rows, cols, table=tt[1] if len(tt) > 1 else None)
    func = te.create_prim_func([*tt, deq])
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET)
    out = tvm.runtime.empty((rows, cols), "float32")
    lib["main"](*(tvm.runtime.tensor(a) for a in inputs), out)
    ref = _gguf_dequant(b, qtype, rows, cols)
    np.testing.assert_array_equal(out.numpy().view(np.uint32), ref.view(np.uint32))


def _pipeline():
    """The fusion passes of compiler/relax_pipeline.py, the quant schedule, then its VM
    lowering (the CPU backend's own additions left out: this tests the quant kernels)."""

    @tvm.transform.module_pass(opt_level=0, name="cpu_quant")
    def schedule(mod, _ctx):
        return cpu_quant.schedule_module(mod, TARGET)

    fuse = tvm.transform.Sequential(fusion_passes())
    return fuse, schedule, tvm.transform.Sequential(vm_lowering_passes())


def _build(module: nn.Module, spec: dict):
    mod, _ = module.export_tvm({"forward": spec})
    fuse, schedule, lower = _pipeline()
    with TARGET:
        fused = fuse(mod)
        scheduled = schedule(fused)
        ex = tvm.compile(lower(scheduled), target=TARGET, relax_pipeline=None)
    return fused, scheduled, relax.VirtualMachine(ex, tvm.cpu())


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


class _LinearResidual(nn.Module):
    """QuantLinear plus an elementwise epilogue that FuseOps pulls into the same kernel."""

    def __init__(self, k, n, qtype):
        self.proj = QuantLinear(k, n, qtype)

    def forward(self, x, r):
        return self.proj(x) + r


def _check_one_kernel(fused, scheduled):
    funcs = _prim_funcs(fused)
    assert len(funcs) == 1, f"expected one fused kernel, got {sorted(funcs)}"
    ((name, func),) = funcs.items()
    sch = s_tir.Schedule(func)
    sch.get_sblock("dequantize")  # raises if the dequantize block is not inside this kernel
    # after scheduling, each tile of W is dequantized inside the matmul's loops, right before
    # its use (a small buffer after lowering), not all of W into a global buffer first
    sch = s_tir.Schedule(_prim_funcs(scheduled)[name])
    assert "tirx.is_scheduled" in sch.mod["main"].attrs
    outer = sch.get_loops(sch.get_sblock("dequantize"))[0]
    names = {sch.get(b).name_hint for b in sch.get_child_blocks(outer)}
    assert "dequantize" in names and len(names) > 1, names


@pytest.mark.parametrize("qtype", TYPES)
def test_quant_linear_fused_matches_numpy(qtype):
    _check_linear(qtype, 256 + 48 if QUANT_FORMATS[qtype].block_size == 32 else 256)


@pytest.mark.parametrize("n", [200, 40])
def test_quant_linear_without_a_whole_column_tile(n):
    """N divisible by neither column tile (24, 16): the matrix-vector schedule serves."""
    _check_linear("q4_0", n)


def _check_linear(qtype, n):
    k = 512
    b = _blocks(qtype, n, k, seed=2)
    fused, scheduled, vm = _build(
        _LinearResidual(k, n, qtype),
        {"x": nn.spec.Tensor(["m", k], "float32"), "r": nn.spec.Tensor(["m", n], "float32")},
    )
    _check_one_kernel(fused, scheduled)
    w = _gguf_dequant(b, qtype, n, k).astype(np.float64)
    rng = np.random.default_rng(3)
    for m in (1, 3, 17):
        x = rng.standard_normal((m, k)).astype(np.float32)
        r = rng.standard_normal((m, n)).astype(np.float32)
        out = vm["forward"](tvm.runtime.tensor(x), tvm.runtime.tensor(r), tvm.runtime.tensor(b))
        ref = x.astype(np.float64) @ w.T + r
        scale = np.abs(x).astype(np.float64) @ np.abs(w).T  # bound for float32 rounding
        err = np.abs(out.numpy() - ref)
        assert (err <= 1e-5 * scale + 1e-6).all(), f"m={m}: max err {err.max()}"


def test_quant_linear_3d_input_and_larger_k():
    """[batch, seq, K] input as the decoder passes it; K = 1024 over several K-quant blocks."""
    qtype, k, n = "q4k", 1024, 512
    b = _blocks(qtype, n, k, seed=4)
    fused, scheduled, vm = _build(
        QuantLinear(k, n, qtype), {"x": nn.spec.Tensor([1, "s", k], "float32")}
    )
    _check_one_kernel(fused, scheduled)
    w = _gguf_dequant(b, qtype, n, k).astype(np.float64)
    x = np.random.default_rng(5).standard_normal((1, 5, k)).astype(np.float32)
    out = vm["forward"](tvm.runtime.tensor(x), tvm.runtime.tensor(b)).numpy()
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("qtype", ["q4_1", "q5_0", "q6k"])
def test_batched_decode_shape_matches_numpy(qtype):
    """[batch, 1, K] as batch_decode passes it: rows padded to whole tiles, tails cut off."""
    k, n = 512, 304
    b = _blocks(qtype, n, k, seed=6)
    fused, scheduled, vm = _build(
        QuantLinear(k, n, qtype), {"x": nn.spec.Tensor(["b", 1, k], "float32")}
    )
    _check_one_kernel(fused, scheduled)
    w = _gguf_dequant(b, qtype, n, k).astype(np.float64)
    rng = np.random.default_rng(7)
    for batch in (1, 3, 6):
        x = rng.standard_normal((batch, 1, k)).astype(np.float32)
        out = vm["forward"](tvm.runtime.tensor(x), tvm.runtime.tensor(b)).numpy()
        np.testing.assert_allclose(out, x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-3)


def test_schedule_rejects_other_kernels():
    x = te.placeholder((4, 64), "float32", name="x")
    y = te.compute((4, 64), lambda i, j: x[i, j] * 2.0, name="dequantize")
    assert cpu_quant.schedule_func(te.create_prim_func([x, y]), TARGET) is None
    w = te.placeholder((8, 64), "float32", name="w")
    kk = te.reduce_axis((0, 64), "k")
    mm = te.compute((4, 8), lambda i, j: te.sum(x[i, kk] * w[j, kk], axis=kk), name="matmul")
    assert cpu_quant.schedule_func(te.create_prim_func([x, w, mm]), TARGET) is None


@pytest.mark.parametrize("qtype", TYPES)
def test_quant_embedding_rows(qtype):
    num, dim = 40, 512
    b = _blocks(qtype, num, dim, seed=6)
    mod, _ = QuantEmbedding(num, dim, qtype).export_tvm(
        {"forward": {"ids": nn.spec.Tensor(["t"], "int32")}}
    )
    ex = tvm.compile(mod, target=TARGET)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    ids = np.array([7, 0, 39, 7, 21], dtype=np.int32)
    out = vm["forward"](tvm.runtime.tensor(ids), tvm.runtime.tensor(b)).numpy()
    ref = _gguf_dequant(b, qtype, num, dim)[ids]
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))
