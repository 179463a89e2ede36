"""AMX prefill kernels (schedules/cpu/amx_prefill.py): bf16 tiles on Sapphire Rapids and newer.

The oracle is numpy in float64 on `gguf.quants.dequantize`'s weights, the activations and
the weights both rounded to bf16 to nearest even, as the kernel rounds them; calls of fewer
than `MIN_ROWS` rows take the VNNI tiles, bit for bit `int8_prefill`'s kernel. Kernels run
only on a CPU with AMX; the pass and the runtime's permission logic are checked anywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_int8_decode import TARGET, _activations, _weights
from test_int8_prefill import INT8_TYPES, LATTICE_TYPES, _build, _Projections, _table
from tvm.relax.frontend import nn

from tallow.compiler.int8_prefill_pass import int8_prefill_kernels
from tallow.compiler.target import BuildReport
from tallow.runtime import cpu_features
from tallow.schedules.cpu import amx_prefill
from tallow.schedules.cpu.int8_prefill import prefill_kernel

HAS_AMX = amx_prefill.supported(TARGET) and cpu_features.request_amx_tiles()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU (or kernel) gives no AMX tiles")


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 rounded to bf16 (to nearest even), as float64."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


@needs_amx
@pytest.mark.parametrize("qtype", INT8_TYPES + LATTICE_TYPES)
def test_amx_prefill_matches_bf16_numpy(qtype):
    """Every format with int8 groups, 64 columns (two tasks of 32), 2 super-blocks a row:
    a call of 40 rows (one tile, passes of 32 past its rows) and of 133 (a second tile of 5
    rows) against the bf16 oracle, and a row's bits the same in both calls; 5 rows, the VNNI
    tiles, bit for bit."""
    k, n = 512, 64
    blocks, deq = _weights(qtype, n, k, seed=71)
    extra = _table(qtype) if qtype in LATTICE_TYPES else []
    lib = _build(amx_prefill.amx_prefill_kernel(qtype, n, k))
    vnni = _build(prefill_kernel(qtype, n, k))
    rows = _activations(133, k, seed=72)
    first = None
    for tokens in (5, 40, 133):
        x = np.ascontiguousarray(rows.reshape(133, k)[:tokens])
        got, few = (tvm.runtime.empty((1, tokens, n), "float32") for _ in range(2))
        args = [tvm.runtime.tensor(x.reshape(1, tokens, k)), tvm.runtime.tensor(blocks), *extra]
        lib["main"](*args, got)
        vnni["main"](*args, few)
        got, few = got.numpy().reshape(tokens, n), few.numpy().reshape(tokens, n)
        if tokens < amx_prefill.MIN_ROWS:
            np.testing.assert_array_equal(got, few)
            continue
        xb, wb = _bf16(x.reshape(tokens, k)), _bf16(deq)
        ref, bound = xb @ wb.T, np.abs(xb) @ np.abs(wb).T
        err = np.abs(got - ref)
        assert (err <= 1e-5 * bound + 1e-6).all(), f"{tokens} rows: max err {err.max()}"
        # the bf16 path really ran, and nearer float than the int8 tiles' rounding (about
        # 2x on these Gaussian rows; 10-15x on a row with an outlier)
        exact = x.reshape(tokens, k).astype(np.float64) @ deq.T
        assert np.abs(got - exact).max() * 1.3 < np.abs(few - exact).max()
        if first is None:
            first = got
        else:  # a row's result does not depend on the call's other rows
            np.testing.assert_array_equal(got[: len(first)], first)


def test_pass_gives_amx_kernels_where_columns_allow():
    """With AMX the prefill matmul of 64 columns takes the AMX kernel and the report says
    from how many rows; 48 columns (not whole 32-column tasks) keep the VNNI tiles. Only TIR
    is built: this runs on any CPU."""
    specs = {"prefill": {"x": nn.spec.Tensor([1, "s", 256], "float32")}}
    for n, block in ((64, "dot_amx"), (48, "dot_vnni")):
        mod, _ = _Projections(256, n, "q4k").export_tvm(specs)
        report = BuildReport()
        out = int8_prefill_kernels(report, vnni=True, amx=True)(mod)
        (kernel,) = [f for _, f in out.functions_items() if f'T.sblock("{block}")' in f.script()]
        assert int(kernel.attrs["op_pattern"]) == 8
        assert report.to_details() == {
            "prefill_activations": "int8_g32_row_step",
            "int8_prefill_kernels": 1,
            "prefill_bf16_amx_from_rows": amx_prefill.MIN_ROWS,
        }


def test_amx_counts_only_when_linux_gives_the_tiles(monkeypatch):
    """A CPU with AMX whose kernel refuses the tile state reports no AMX feature, so an AMX
    library is refused at load (library_select) instead of dying on SIGILL."""
    flags = frozenset({"avx2", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"})
    monkeypatch.setattr(cpu_features, "parse_cpuinfo", lambda _text: flags)
    monkeypatch.setattr(cpu_features, "host_os", lambda: "linux")
    monkeypatch.setattr(cpu_features, "request_amx_tiles", lambda: False)
    assert cpu_features.host_features() == {"avx2", "avx512_vnni"}
    monkeypatch.setattr(cpu_features, "request_amx_tiles", lambda: True)
    assert cpu_features.host_features() == flags


def test_deterministic_runs_give_each_chunk_its_own_call():
    """With prefill's path chosen by a call's row count, two chunks in one forward could
    take AMX together where each alone would not: deterministic runs split them, and keep
    single tokens apart from chunks as before."""
    from types import SimpleNamespace

    from tallow.runtime.model_runner import TVMModelRunner

    mixes = TVMModelRunner._mixes_paths
    switch = SimpleNamespace(prefill_rows_switch=32)
    plain = SimpleNamespace(prefill_rows_switch=None)
    assert mixes(switch, [5, 7]) and not mixes(plain, [5, 7])
    assert mixes(plain, [1, 7]) and mixes(switch, [1, 7])
    assert not mixes(switch, [1, 1]) and not mixes(switch, [9])
