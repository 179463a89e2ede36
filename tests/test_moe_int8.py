"""The int8-activation grouped expert matmul (schedules/cpu/moe_int8.py) against numpy.

The oracle is the dense int8 kernels' (`test_int8_decode`): `gguf.quants.dequantize` of the
weights times the activations rounded as `cpu.int8_ops` documents, in float64, within the
float32 rounding of the sums. Every format, gathered (gate, up) and in-order (down) input;
the routing has experts with 1, 2 and more than 16 rows (a whole tile plus a rest) and
experts nobody picked, whose weight blocks hold garbage (0xff bytes: a NaN scale in the
formats with f16 scales), which any read would spread to the output.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_int8_decode import TARGET, _activations, _oracle, _weights, needs_vnni

from tallow.compiler.quant import QUANT_FORMATS
from tallow.schedules.cpu import moe_int8

EXPERTS, N_OUT = 6, 32  # two 16-column blocks: two parallel tasks
TOP_K = 2
# expert of each (token, slot) pair: expert 0 gets 18 rows (a tile of 16 and 2), expert 2
# one, expert 3 two, expert 5 the rest; experts 1 and 4 none
IDS = np.array([[0, 5]] * 18 + [[2, 5], [3, 5], [5, 3]], np.int32)
UNUSED = (1, 4)


def _grouping():
    flat = IDS.reshape(-1)
    counts = np.bincount(flat, minlength=EXPERTS)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = (np.argsort(flat, kind="stable") // TOP_K).astype(np.int32)
    used = np.flatnonzero(counts)
    active = np.zeros(EXPERTS + 1, np.int32)
    active[0], active[1 : 1 + len(used)] = len(used), used
    return indptr, rows, active


def _build(qtype: str, k: int):
    kernels = {
        # gate/up as in decode, one column block per task; down as in prefill, two
        "gather": moe_int8.grouped_int8_kernel(EXPERTS, N_OUT, k, qtype, True),
        "in_order": moe_int8.grouped_int8_kernel(EXPERTS, N_OUT, k, qtype, False, wide_rows=1),
    }
    mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in kernels.items()})
    with TARGET:
        return tvm.compile(mod, TARGET)


# The per-format tiles are the dense ones (`test_int8_prefill` covers all ten); what is new
# here, the grouping, the gather and the per-expert weight view, meets each kind of tile: a
# legacy 32-block format, a K-quant with block scales (its own tile), one with 16-weight
# halves. All ten run through the experts in `test_models_moe` (slow).
@needs_vnni
@pytest.mark.parametrize("qtype", ["q4_0", "q4k", "q6k"])
def test_grouped_int8_matches_numpy(qtype):
    k = 64 if QUANT_FORMATS[qtype].block_size == 32 else 256
    tokens, n = len(IDS), IDS.size
    blocks, deq = _weights(qtype, EXPERTS * N_OUT, k, seed=41)
    for e in UNUSED:
        blocks[e * N_OUT : (e + 1) * N_OUT] = 0xFF
    stack = deq.reshape(EXPERTS, N_OUT, k)
    indptr, rows, active = _grouping()
    lib = _build(qtype, k)
    for gather in (True, False):
        x = _activations(tokens if gather else n, k, seed=42).reshape(-1, k)
        y = tvm.runtime.empty((n, N_OUT), "float32")
        args = [tvm.runtime.tensor(a) for a in (x, rows, indptr, active, blocks)]
        lib["gather" if gather else "in_order"](*args, y)
        got = y.numpy()
        assert np.isfinite(got).all()
        for e in np.flatnonzero(np.diff(indptr)):
            lo, hi = indptr[e], indptr[e + 1]
            inputs = x[rows[lo:hi]] if gather else x[lo:hi]
            ref, bound = (a.reshape(hi - lo, N_OUT) for a in _oracle(inputs[:, None], stack[e]))
            err = np.abs(got[lo:hi] - ref)
            assert (err <= 1e-5 * bound + 1e-6).all(), f"{qtype} expert {e}: {err.max()}"
            float_ref = inputs.astype(np.float64) @ stack[e].T
            if hi - lo > 2:  # the rounding is really there
                assert np.abs(got[lo:hi] - float_ref).max() > 1e-3


def test_int8_only_where_the_dense_kernels_would():
    """Float weights, shapes the tiles cannot cover and targets without AVX-512 VNNI (or no
    target: a GPU's kernels) keep the float kernel."""
    from tvm.target import Target

    avx2_only = Target({"kind": "llvm", "mcpu": "znver3"})
    assert moe_int8.supports("q4_0", 32, 256, Target({"kind": "llvm", "mcpu": "znver4"}))
    assert not moe_int8.supports("q4_0", 32, 256, avx2_only)
    assert not moe_int8.supports("q4_0", 32, 256, None)
    assert not moe_int8.supports("none", 32, 256, TARGET)
    assert not moe_int8.supports("q4_0", 24, 256, TARGET)  # 24 columns: not whole tiles
    assert not moe_int8.supports("q4_0", 32, 48, TARGET)  # 48 weights: not whole groups
    with pytest.raises(ValueError, match="int8 grouped matmul needs"):
        moe_int8.grouped_int8_kernel(EXPERTS, 24, 256, "q4_0", True)
