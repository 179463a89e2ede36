"""The grouped mixture-of-experts kernels (schedules/moe.py) on the CPU against numpy: the
router's top k and its normalisation, the grouping of (token, slot) pairs by expert with
experts nobody picked, the grouped matmul over float and every GGUF block format's
stacked experts (whose oracle is the `gguf` package's own dequantizer), and the weighted
sum that brings each token's rows back."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import tvm

from tallow.compiler.quant import QUANT_FORMATS, quantize
from tallow.schedules.moe import (
    combine_kernel,
    group_kernel,
    grouped_matmul_kernel,
    route_kernel,
)

# the formats the grouped kernels take (the lattice i-quants: refused, test_iquants_grid)
MOE_TYPES = [f for f, fmt in QUANT_FORMATS.items() if fmt.table is None]

EXPERTS, TOP_K, TOKENS, K_DIM, N_OUT = 8, 2, 7, 256, 8
# experts 5 and 7 are never picked; the others by different tokens
LOGIT_BIAS = np.array([0.0, 0.5, 0.2, -0.1, 0.3, -40.0, 0.1, -40.0], np.float32)


@pytest.fixture(scope="module")
def kernels():
    funcs = {
        "route_norm": route_kernel(EXPERTS, TOP_K, True, "float32", False),
        "route_raw": route_kernel(EXPERTS, TOP_K, False, "float32", False),
        "group": group_kernel(EXPERTS, TOP_K, False),
        "combine": combine_kernel(N_OUT, TOP_K, "float32", False),
        "down_f32": grouped_matmul_kernel(
            EXPERTS, N_OUT, K_DIM, "none", "float32", "float32", False, False
        ),
    }
    for fmt in MOE_TYPES:
        funcs[f"gate_{fmt}"] = grouped_matmul_kernel(
            EXPERTS, N_OUT, K_DIM, fmt, "float32", "float32", True, False
        )
    mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()})
    return tvm.compile(mod, target="llvm")


def _run(lib, name, *arrays, outs):
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    out = [tvm.runtime.tensor(np.zeros(s, d), dev) for s, d in outs]
    lib[name](*args, *out)
    return [o.numpy() for o in out]


def _routing(lib, normalise: bool):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((TOKENS, EXPERTS)) + LOGIT_BIAS).astype(np.float32)
    name = "route_norm" if normalise else "route_raw"
    outs = [((TOKENS, TOP_K), "float32"), ((TOKENS, TOP_K), "int32")]
    weights, ids = _run(lib, name, logits, outs=outs)
    return logits, weights, ids


@pytest.mark.parametrize("normalise", [True, False])
def test_route_picks_top_k_with_the_family_normalisation(kernels, normalise):
    logits, weights, ids = _routing(kernels, normalise)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    want_ids = np.argsort(-probs, axis=1, kind="stable")[:, :TOP_K]
    want = np.take_along_axis(probs, want_ids, 1)
    if normalise:
        want = want / want.sum(1, keepdims=True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want, rtol=1e-6, atol=1e-7)


def _grouping(lib):
    _, weights, ids = _routing(lib, True)
    n = TOKENS * TOP_K
    outs = [((EXPERTS + 1,), "int32"), ((n,), "int32"), ((n,), "int32"), ((EXPERTS + 1,), "int32")]
    indptr, rows, slot, active = _run(lib, "group", ids, outs=outs)
    return weights, ids, indptr, rows, slot, active


def test_group_sorts_pairs_by_expert_and_lists_the_active_ones(kernels):
    _, ids, indptr, rows, slot, active = _grouping(kernels)
    counts = np.bincount(ids.reshape(-1), minlength=EXPERTS)
    assert counts[5] == counts[7] == 0 and (counts > 0).sum() >= 4
    np.testing.assert_array_equal(indptr, np.concatenate([[0], np.cumsum(counts)]))
    used = np.flatnonzero(counts)
    assert active[0] == len(used)
    np.testing.assert_array_equal(active[1 : 1 + len(used)], used)
    assert sorted(slot.tolist()) == list(range(TOKENS * TOP_K))  # a permutation
    for q, e in enumerate(ids.reshape(-1)):
        assert indptr[e] <= slot[q] < indptr[e + 1]
        assert rows[slot[q]] == q // TOP_K


def _reference(x_rows, stack, ids, indptr, rows, gather=True):
    """numpy: each sorted row times its expert's [N_OUT, K_DIM] weight."""
    out = np.zeros((TOKENS * TOP_K, N_OUT), np.float32)
    for e in range(EXPERTS):
        for r in range(indptr[e], indptr[e + 1]):
            xr = x_rows[rows[r]] if gather else x_rows[r]
            out[r] = stack[e] @ xr
    return out


@pytest.mark.parametrize("fmt", MOE_TYPES)
def test_grouped_matmul_dequantizes_every_block_format(kernels, fmt):
    rng = np.random.default_rng(1)
    _, ids, indptr, rows, _, active = _grouping(kernels)
    x = rng.standard_normal((TOKENS, K_DIM)).astype(np.float32)
    w = rng.standard_normal((EXPERTS * N_OUT, K_DIM)).astype(np.float32) * 0.1
    blocks = quantize(w, fmt)
    oracle = gguf.quants.dequantize(blocks, QUANT_FORMATS[fmt].ggml_type)
    stack = oracle.reshape(EXPERTS, N_OUT, K_DIM)
    # rows of experts nobody picked hold NaN: a kernel reading them would show it
    n = TOKENS * TOP_K
    (y,) = _run(
        kernels, f"gate_{fmt}", x, rows, indptr, active, blocks, outs=[((n, N_OUT), "float32")]
    )
    want = _reference(x, stack, ids, indptr, rows)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_grouped_matmul_skips_experts_without_rows(kernels):
    """Float weights, input already in sorted order (the down projection); the experts
    nobody picked hold NaN, which would poison any output that read them."""
    rng = np.random.default_rng(2)
    _, ids, indptr, rows, _, active = _grouping(kernels)
    n = TOKENS * TOP_K
    h = rng.standard_normal((n, K_DIM)).astype(np.float32)
    w = rng.standard_normal((EXPERTS, N_OUT, K_DIM)).astype(np.float32)
    w[5] = w[7] = np.nan
    flat = w.reshape(EXPERTS * N_OUT, K_DIM)
    (y,) = _run(kernels, "down_f32", h, rows, indptr, active, flat, outs=[((n, N_OUT), "float32")])
    w[5] = w[7] = 0
    want = _reference(h, w, ids, indptr, rows, gather=False)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4)


def test_combine_weights_each_tokens_rows(kernels):
    rng = np.random.default_rng(3)
    weights, ids, indptr, rows, slot, active = _grouping(kernels)
    y = rng.standard_normal((TOKENS * TOP_K, N_OUT)).astype(np.float32)
    (out,) = _run(kernels, "combine", y, slot, weights, outs=[((TOKENS, N_OUT), "float32")])
    want = np.zeros((TOKENS, N_OUT), np.float32)
    for t in range(TOKENS):
        for k in range(TOP_K):
            want[t] += weights[t, k] * y[slot[t * TOP_K + k]]
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_grouped_matmul_takes_a_width_that_is_no_multiple_of_8(kernels):
    """A tensor-parallel worker's slice of an expert can be 12 columns wide (48 / 4): the CPU
    kernel then runs one lane at a time (it failed to build before: no 1-lane Ramp)."""
    k_dim = 12
    func = grouped_matmul_kernel(EXPERTS, N_OUT, k_dim, "none", "float32", "float32", True, False)
    lib = tvm.compile(tvm.IRModule({"g": func.with_attr("global_symbol", "g")}), target="llvm")
    rng = np.random.default_rng(4)
    _, ids, indptr, rows, _, active = _grouping(kernels)
    x = rng.standard_normal((TOKENS, k_dim)).astype(np.float32)
    w = rng.standard_normal((EXPERTS, N_OUT, k_dim)).astype(np.float32)
    n = TOKENS * TOP_K
    (y,) = _run(
        lib, "g", x, rows, indptr, active, w.reshape(-1, k_dim), outs=[((n, N_OUT), "float32")]
    )
    want = np.zeros((n, N_OUT), np.float32)
    for e in range(EXPERTS):
        for r in range(indptr[e], indptr[e + 1]):
            want[r] = w[e] @ x[rows[r]]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
