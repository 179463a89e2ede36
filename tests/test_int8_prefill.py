"""Int8-activation prefill kernels (schedules/cpu/int8_prefill.py, compiler/int8_prefill_pass.py).

The oracle is the one of `test_int8_decode`: `gguf.quants.dequantize` of the weights times
the activations rounded as `cpu.int8_ops` documents, in numpy float64.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import tvm
from test_int8_decode import TARGET, _activations, _oracle, _weights, needs_vnni
from tvm.relax.frontend import nn

from tallow.compiler.int8_prefill_pass import int8_prefill_kernels
from tallow.compiler.quant import QUANT_FORMATS
from tallow.compiler.target import BuildReport
from tallow.model_defs.quant_ops import QuantLinear
from tallow.schedules.cpu import int8_gemv, int8_prefill_columns
from tallow.schedules.cpu.int8_prefill import prefill_kernel

# the formats with int8-activation kernels (the TQ types have none: float kernels) beyond
# `decode`'s one row (the lattice i-quants, `int8_codes.has_table`, below: a third input)
INT8_TYPES = [q for q, f in QUANT_FORMATS.items() if f.int8 is not None and f.table is None]

SAME_AS_DECODE = ("q5_0", "q4k", "q6k", "q8_0")
# the lattice i-quants with int8 groups: their grid is a third kernel input (x, w, table, out)
LATTICE_TYPES = [q for q, f in QUANT_FORMATS.items() if f.int8 is not None and f.table]


def _table(qtype: str) -> list:
    return [tvm.runtime.tensor(np.ascontiguousarray(QUANT_FORMATS[qtype].table()))]


def _build(func):
    with TARGET:
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), TARGET)


@needs_vnni
@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_prefill_matches_numpy(qtype):
    """Every format, `[1, tokens, K]`: token counts below one 128-row tile (3, 37) and a
    whole one plus a rest (133 = 128 + 5), and 64 output columns (four parallel blocks); each
    token row is the product of its rounded activations, so also equal to `batch_decode`'s
    kernel."""
    k = 96 if QUANT_FORMATS[qtype].block_size == 32 else 512
    n = 64
    blocks, deq = _weights(qtype, n, k, seed=31)
    lib = _build(prefill_kernel(qtype, n, k))
    # the formats of a Q4_K_M mix: also bit for bit batch_decode's rows (a second compile)
    decode = None
    if qtype in SAME_AS_DECODE:
        decode = _build(int8_gemv.gemv_kernel(qtype, n, k, None, vnni=True))
    for tokens in (3, 37, 133):
        x = _activations(tokens, k, seed=32 + tokens)
        out = tvm.runtime.empty((1, tokens, n), "float32")
        lib["main"](tvm.runtime.tensor(x.reshape(1, tokens, k)), tvm.runtime.tensor(blocks), out)
        got = out.numpy().reshape(tokens, n)
        ref, bound = (a.reshape(tokens, n) for a in _oracle(x, deq))
        err = np.abs(got - ref)
        assert (err <= 1e-5 * bound + 1e-6).all(), f"{tokens} tokens: max err {err.max()}"
        float_ref = x.reshape(tokens, k).astype(np.float64) @ deq.T
        assert np.abs(got - float_ref).max() > 1e-3  # the rounding is really there
        if decode is not None:
            rows = tvm.runtime.empty((tokens, 1, n), "float32")
            decode["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(blocks), rows)
            np.testing.assert_array_equal(got, rows.numpy().reshape(tokens, n))


needs_avx2 = pytest.mark.skipif(not int8_gemv.supported(TARGET), reason="this CPU has no AVX2")
COLUMN_FORMATS = [q for q in QUANT_FORMATS if int8_prefill_columns.supported(q)]
# the formats whose batch_decode takes the same column tiles: rows equal bit for bit
COLUMNS_IN_DECODE = [q for q in COLUMN_FORMATS if QUANT_FORMATS[q].int8.column_tiles]


@needs_avx2
@pytest.mark.parametrize("qtype", COLUMN_FORMATS)
def test_avx2_prefill_matches_numpy(qtype):
    """AVX2 column tiles over the tokens: below one tile of `ROWS` rows (3, 37), a whole one
    plus a rest (`ROWS + 5`), 64 output columns (8 parallel blocks); the lattice i-quants with
    their grid as a third input (each row's codes decoded once a group). Each row is the product of
    its rounded activations; where batch_decode takes the column tiles too, bit for bit its
    rows; and a row's bits do not depend on the tile it lands in or its place there (the last 3
    rows of `ROWS + 5` tokens sit in the second tile, alone they are the first tile's first
    rows: `--deterministic` prefills a prompt in chunks)."""
    k = 96 if QUANT_FORMATS[qtype].block_size == 32 else 512
    n = 64
    blocks, deq = _weights(qtype, n, k, seed=41)
    lib = _build(int8_prefill_columns.prefill_kernel(qtype, n, k))
    grid = _table(qtype) if qtype in LATTICE_TYPES else []  # (x, w, table, out)
    decode = None
    if qtype in COLUMNS_IN_DECODE:
        decode = _build(int8_gemv.gemv_kernel(qtype, n, k, None, vnni=False))
    longest = int8_prefill_columns.ROWS + 5
    x_all = _activations(longest, k, seed=42)
    results = {}
    for tokens in (3, 37, longest):
        x = x_all[-tokens:]  # the last rows: each count puts a row in another tile position
        out = tvm.runtime.empty((1, tokens, n), "float32")
        lib["main"](
            tvm.runtime.tensor(x.reshape(1, tokens, k)), tvm.runtime.tensor(blocks), *grid, out
        )
        got = out.numpy().reshape(tokens, n)
        ref, bound = (a.reshape(tokens, n) for a in _oracle(x, deq))
        err = np.abs(got - ref)
        assert (err <= 1e-5 * bound + 1e-6).all(), f"{tokens} tokens: max err {err.max()}"
        float_ref = x.reshape(tokens, k).astype(np.float64) @ deq.T
        assert np.abs(got - float_ref).max() > 1e-3  # the rounding is really there
        results[tokens] = got
        if decode is not None:
            rows = tvm.runtime.empty((tokens, 1, n), "float32")
            decode["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(blocks), *grid, rows)
            np.testing.assert_array_equal(got, rows.numpy().reshape(tokens, n))
    np.testing.assert_array_equal(results[3], results[longest][-3:])
    np.testing.assert_array_equal(results[37], results[longest][-37:])


def _iq3_s_at_extremes(signs: np.ndarray) -> np.ndarray:
    """IQ3_S rows whose every 4 weights are the grid entry (15, 15, 1, 1): the first pair of
    each step at the grid's largest value; signs of `signs` (n, k: +-1), and every group scale
    the largest (d * 31)."""
    n, k = signs.shape
    grid = QUANT_FORMATS["iq3_s"].table().reshape(-1, 4)
    (index,) = np.flatnonzero((grid == (15, 15, 1, 1)).all(axis=1))  # 9 bits: byte, high bit
    blocks = np.zeros((n, k // 256, 110), np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks[..., 2:66] = index & 0xFF
    blocks[..., 66:74] = 0xFF if index >> 8 else 0
    negative = (signs < 0).reshape(n, k // 256, 256)
    blocks[..., 74:106] = np.packbits(negative, axis=-1, bitorder="little")
    blocks[..., 106:110] = 0xFF
    return blocks.reshape(n, -1)


@needs_avx2
def test_avx2_lattice_prefill_at_the_int16_bound():
    """iq3_s in the column tiles as unsigned codes (`int8_columns.unsigned_view`: (code + 15)
    / 2, 8 steps summed in int16 and the multiplier applied in int32): every weight at the
    grid's largest value against full-scale activations of the same signs, so each int16 lane
    reaches 8 x 2 x 15 x 127 = 30480 (the steps' first pairs) and every group's multiplier is
    the largest. An overflow would show as a huge error."""
    k, n, tokens = 512, 16, 6
    signs = np.random.default_rng(13).choice([-1.0, 1.0], size=(n, k))
    blocks = _iq3_s_at_extremes(signs)
    deq = gguf.quants.dequantize(blocks, QUANT_FORMATS["iq3_s"].ggml_type).reshape(n, k)
    assert (np.abs(deq[:, 0::4]) == np.abs(deq).max()).all()  # the pairs at the extreme
    x = np.stack([signs[i % n] * (1 - 2 * (i % 2)) for i in range(tokens)]).astype(np.float32)
    x = x.reshape(tokens, 1, k) * 3
    out = tvm.runtime.empty((1, tokens, n), "float32")
    lib = _build(int8_prefill_columns.prefill_kernel("iq3_s", n, k))
    lib["main"](
        tvm.runtime.tensor(x.reshape(1, tokens, k)),
        tvm.runtime.tensor(blocks),
        *_table("iq3_s"),
        out,
    )
    ref, bound = (a.reshape(tokens, n) for a in _oracle(x, deq.astype(np.float64)))
    err = np.abs(out.numpy().reshape(tokens, n) - ref)
    assert (err <= 1e-5 * bound + 1e-6).all(), f"max err {err.max()}"
    assert np.abs(ref).max() > 0.99 * bound.max()  # a row of same-sign products really ran


@needs_vnni
@pytest.mark.parametrize("qtype", LATTICE_TYPES)
def test_lattice_prefill_matches_numpy(qtype):
    """The lattice i-quants in the VNNI tiles (each row's codes decoded once into a buffer,
    then transposed): 3, 37 and 133 tokens, 64 columns, 2 super-blocks a row."""
    k, n = 512, 64
    blocks, deq = _weights(qtype, n, k, seed=61)
    lib = _build(prefill_kernel(qtype, n, k))
    for tokens in (3, 37, 133):
        x = _activations(tokens, k, seed=62 + tokens)
        out = tvm.runtime.empty((1, tokens, n), "float32")
        lib["main"](
            tvm.runtime.tensor(x.reshape(1, tokens, k)),
            tvm.runtime.tensor(blocks),
            *_table(qtype),
            out,
        )
        ref, bound = (a.reshape(tokens, n) for a in _oracle(x, deq))
        err = np.abs(out.numpy().reshape(tokens, n) - ref)
        assert (err <= 1e-5 * bound + 1e-6).all(), f"{tokens} tokens: max err {err.max()}"


class _Projections(nn.Module):
    def __init__(self, k, n, qtype):
        self.proj = QuantLinear(k, n, qtype)

    def prefill(self, x):
        return self.proj(x)

    decode = batch_decode = rows = prefill


@pytest.mark.parametrize(("vnni", "block"), [(True, "dot_vnni"), (False, "dot_columns")])
def test_pass_replaces_prefill_kernels_only(vnni, block):
    """`[1, s, K]` gets the int8 prefill kernel of the CPU level (AVX-512 VNNI or AVX2);
    decode shapes and a 2-D input keep theirs; the report says which activations prefill
    uses. Only TIR is built: this runs on any CPU."""
    k, n, qtype = 256, 32, "q4k"
    specs = {
        "prefill": {"x": nn.spec.Tensor([1, "s", k], "float32")},
        "decode": {"x": nn.spec.Tensor([1, 1, k], "float32")},
        "batch_decode": {"x": nn.spec.Tensor(["b", 1, k], "float32")},
        "rows": {"x": nn.spec.Tensor(["m", k], "float32")},
    }
    mod, _ = _Projections(k, n, qtype).export_tvm(specs)
    report = BuildReport()
    out = int8_prefill_kernels(report, vnni=vnni)(mod)
    int8 = [f for _, f in out.functions_items() if f'T.sblock("{block}")' in f.script()]
    floats = [f for _, f in out.functions_items() if "dequantize" in f.script()]
    assert len(int8) == 1 and len(floats) == 3
    assert int(int8[0].attrs["op_pattern"]) == 8
    assert report.to_details() == {
        "prefill_activations": "int8_g32_row_step",
        "int8_prefill_kernels": 1,
    }


@pytest.mark.parametrize(("vnni", "block"), [(True, "dot_vnni"), (False, "dot_columns")])
def test_pass_gives_the_lattice_formats_int8_tiles(vnni, block):
    """On both levels the tiles take the grid as the fused kernel did (x, w, table, out), so
    an IQ3_S projection's prefill gets int8 activations (its numbers:
    `test_lattice_prefill_matches_numpy`, `test_avx2_prefill_matches_numpy`). Only TIR is
    built: this runs on any CPU."""
    k, n = 256, 32
    mod, _ = _Projections(k, n, "iq3_s").export_tvm(
        {"prefill": {"x": nn.spec.Tensor([1, "s", k], "float32")}}
    )
    report = BuildReport()
    out = int8_prefill_kernels(report, vnni=vnni)(mod)
    (int8,) = [f for _, f in out.functions_items() if f'T.sblock("{block}")' in f.script()]
    assert len(int8.params) == 4
    assert report.to_details() == {
        "prefill_activations": "int8_g32_row_step",
        "int8_prefill_kernels": 1,
    }
