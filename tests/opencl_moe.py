"""The mixture-of-experts kernels (`schedules/moe.py`, scheduled by hand for GPUs) chained
as `MoEMLP` calls them, one of `opencl_cases.small_cases` (run on OpenCL devices and, in f16,
through wgpu)."""

from __future__ import annotations

import gguf
import numpy as np
from opencl_runner import F16_TINY, F16_ULP, OpenCLKernels

from tallow.compiler.quant import QUANT_FORMATS, quantize


def check_moe(
    qtype: str = "q4k",
    tokens: int = 5,
    experts: int = 6,
    top_k: int = 2,
    hidden: int = 256,
    n_out: int = 64,
    dtype: str = "float32",
    runner=OpenCLKernels,
):
    """Route, group by expert, the grouped matmul over `qtype`'s stacked experts (as gate /
    up read it, through the row list) and the weighted combine, chained as `MoEMLP` calls
    them, each stage against numpy. Two experts get no token (their rows are never read).
    In f16 (`dtype`) logits, activations and expert rows are f16: the grouped matmul sums in
    f32 and rounds once; the combine computes in f16 (router weight rounded to f16, as
    transformers does, then two products and a sum, each rounded: 3 x `F16_ULP`)."""
    from tallow.schedules import moe

    kernels = runner(
        {
            "route": moe.route_kernel(experts, top_k, True, dtype, True),
            "group": moe.group_kernel(experts, top_k, True),
            "grouped": moe.grouped_matmul_kernel(
                experts, n_out, hidden, qtype, dtype, dtype, True, True
            ),
            "combine": moe.combine_kernel(n_out, top_k, dtype, True),
        }
    )
    half = dtype == "float16"
    rng = np.random.default_rng(3)
    bias = np.zeros(experts, np.float32)
    bias[-2:] = -40.0  # never picked
    logits = (rng.standard_normal((tokens, experts)) + bias).astype(dtype)
    w = np.zeros((tokens, top_k), np.float32)
    ids = np.full((tokens, top_k), -7, np.int32)
    kernels.run("route", {"logits": logits, "w": w, "ids": ids}, {"n": tokens})
    l64 = logits.astype(np.float64)
    p = np.exp(l64 - l64.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref_ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    ref_w = np.take_along_axis(p, ref_ids, -1)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w / ref_w.sum(-1, keepdims=True), rtol=1e-5)

    pairs = tokens * top_k
    group = {
        "ids": ids,
        "indptr": np.full(experts + 1, -7, np.int32),
        "rows": np.full(pairs, -7, np.int32),
        "slot": np.full(pairs, -7, np.int32),
        "active": np.full(experts + 1, -7, np.int32),
    }
    kernels.run("group", group, {"n": tokens})
    counts = np.bincount(ids.ravel(), minlength=experts)
    np.testing.assert_array_equal(group["indptr"], np.concatenate([[0], np.cumsum(counts)]))
    assert list(group["active"][1 : group["active"][0] + 1]) == list(np.flatnonzero(counts))

    x = rng.standard_normal((tokens, hidden)).astype(dtype)
    stack = rng.standard_normal((experts * n_out, hidden)).astype(np.float32)
    blocks = quantize(stack, qtype)
    dense = np.asarray(gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type))
    dense = dense.reshape(experts * n_out, hidden).astype(np.float64)
    y = np.full((pairs, n_out), np.nan, dtype)
    arrays = {
        "x": x,
        "rows": group["rows"],
        "indptr": group["indptr"],
        "active": group["active"],
        "w": blocks,
        "y": y,
    }
    kernels.run("grouped", arrays, {"m": tokens, "n": pairs})
    ref_y = np.empty((pairs, n_out))
    for e in range(experts):
        lo, hi = group["indptr"][e], group["indptr"][e + 1]
        rows = x[group["rows"][lo:hi]].astype(np.float64)
        ref_y[lo:hi] = rows @ dense[e * n_out : (e + 1) * n_out].T
    bound = 1e-5 * (np.abs(x[group["rows"]]).astype(np.float64) @ np.abs(dense[:n_out]).T) + 1e-4
    bound += F16_ULP * np.abs(ref_y) if half else 0
    assert (np.abs(y - ref_y) <= 10 * bound).all(), np.nanmax(np.abs(y - ref_y))

    out = np.full((tokens, n_out), np.nan, dtype)
    arrays = {"y": y, "slot": group["slot"], "w": w, "out": out}
    kernels.run("combine", arrays, {"n": tokens, "m": pairs})
    terms = w.astype(dtype)[..., None].astype(np.float64) * y[group["slot"]].reshape(
        tokens, top_k, n_out
    )
    ref = terms.sum(1)
    if half:
        bound = 3 * F16_ULP * np.abs(terms).sum(1) + F16_TINY
        assert (np.abs(out - ref) <= bound).all(), np.nanmax(np.abs(out - ref) / bound)
        return
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
