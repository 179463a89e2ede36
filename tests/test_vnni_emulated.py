"""The AVX-512 VNNI int8 kernels' logic on any x86 CPU with AVX2: `vpdpbusd` emulated.

`test_int8_decode` and `test_int8_prefill` run the VNNI kernels only on CPUs that have the
instruction. Here every other part of them (each format's code and scale decoding, the
transposes, the signed codes' flip to `code + 128` and its offset, the tails) runs on this
CPU: `int8_vnni._vpdpbusd`, the one AVX-512 VNNI intrinsic, is replaced by the same
arithmetic in plain TIR (unsigned by signed byte products widened to int32, each lane's 4
summed, no saturation: the instruction's definition), which LLVM lowers onto 256-bit
vectors; so are the two AVX-512 instructions of the i-quant row kernels, the 512-bit
`vpshufb` of `int8_table_row` (two 256-bit ones) and the `vpgatherdd` of `int8_grid_row`
(a vector-indexed load). What this cannot show: the instructions themselves and the AVX-512
code generation.

The oracle is `test_int8_decode`'s: `gguf.quants.dequantize` of the weights times the
activations rounded as `cpu.int8_ops` documents, in numpy float64. Checked to fail (max
error 1043) with iq4_xs's flip offset left out of `int8_vnni.tile_macro`.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_int8_decode import TARGET, _activations, _build, _check, _oracle, _weights
from tvm import tirx

from tallow.compiler.quant import QUANT_FORMATS
from tallow.compiler.quant.iquants.int8_groups import table_codes
from tallow.schedules.cpu import (
    int8_gemv,
    int8_grid_row,
    int8_table_row,
    int8_vnni,
    int8_vnni_legacy,
    int8_vnni_row,
)
from tallow.schedules.cpu.int8_prefill import prefill_kernel

# the formats with int8-activation kernels (the TQ types have none: float kernels) beyond
# `decode`'s one row (the lattice i-quants, `int8_codes.has_table`, take a third input)
INT8_TYPES = [q for q, f in QUANT_FORMATS.items() if f.int8 is not None and f.table is None]

pytestmark = pytest.mark.skipif(not int8_gemv.supported(TARGET), reason="this CPU has no AVX2")


def _vpdpbusd_in_plain_tir(acc, codes, x):
    """acc (int32x16) plus, per lane i, sum over j < 4 of u8 codes[4i + j] * s8 x[4i + j]."""
    products = tirx.Cast("int32x64", tirx.reinterpret("uint8x64", codes)) * tirx.Cast(
        "int32x64", tirx.reinterpret("int8x64", x)
    )
    parts = [
        tirx.Shuffle([products], [tirx.const(4 * i + j, "int32") for i in range(16)])
        for j in range(4)
    ]
    return acc + parts[0] + parts[1] + parts[2] + parts[3]


def _lookup_on_avx2(table, indices):
    """`int8_table_row._lookup` (a 512-bit `vpshufb`) as two 256-bit ones."""
    halves = [
        table_codes(
            tirx.Shuffle([indices], [tirx.const(h * 32 + i, "int32") for i in range(32)]), table
        )
        for h in range(2)
    ]
    return tirx.reinterpret(
        "uint8x64", tirx.Shuffle(halves, [tirx.const(i, "int32") for i in range(64)])
    )


def _gather_in_plain_tir(table, indices):
    """`int8_grid_row._gather` (`vpgatherdd`): the 4 bytes at 4 * index, 16 times."""
    four = tirx.Shuffle([indices] * 4, [tirx.const(i // 4, "int32") for i in range(64)])
    offsets = four * tirx.Broadcast(tirx.const(4, "int32"), 64) + tirx.Ramp(
        tirx.const(0, "int32"), 1, 64
    ) % tirx.Broadcast(tirx.const(4, "int32"), 64)
    return tirx.reinterpret("int32x16", tirx.BufferLoad(table, [offsets]))


@pytest.fixture
def emulated(monkeypatch):
    for module in (int8_vnni, int8_vnni_legacy, int8_vnni_row, int8_table_row, int8_grid_row):
        monkeypatch.setattr(module, "_vpdpbusd", _vpdpbusd_in_plain_tir)  # each holds its own
    monkeypatch.setattr(int8_table_row, "_lookup", _lookup_on_avx2)
    monkeypatch.setattr(int8_grid_row, "_gather", _gather_in_plain_tir)


def _k(qtype: str, legacy: int, blocks: int) -> int:
    return legacy if QUANT_FORMATS[qtype].block_size == 32 else blocks


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_vnni_row_kernel(emulated, qtype):
    """`decode`'s VNNI one-row kernel (`int8_vnni_row`): 22 groups (16 and a tail of 6) or
    3 super-blocks, and a row of 2 groups shorter than the legacy 64-byte window."""
    for k in (_k(qtype, 704, 768), _k(qtype, 64, 512)):
        blocks, deq = _weights(qtype, 32, k, seed=31)
        x = _activations(1, k, seed=32)
        kernel = _build(int8_gemv.gemv_kernel(qtype, 32, k, 1, vnni=True))
        _check(kernel(x, blocks, 32), x, deq)


def test_vnni_grid_row_kernel(emulated):
    """`decode`'s VNNI one-row kernel for iq3_s (`int8_grid_row`): 1 and 3 super-blocks, the
    grid table passed as the kernel's third input."""
    for k in (256, 768):
        blocks, deq = _weights("iq3_s", 32, k, seed=41)
        x = _activations(1, k, seed=42)
        kernel = _build(int8_gemv.gemv_kernel("iq3_s", 32, k, 1, vnni=True), "iq3_s")
        _check(kernel(x, blocks, 32), x, deq)


@pytest.mark.parametrize("qtype", [*INT8_TYPES, "iq3_s"])
def test_vnni_tiles(emulated, qtype):
    """`batch_decode`'s 16-column tiles (`int8_vnni`): partial, whole and several tiles of
    sequences, four 16-column blocks; a lattice format with its grid as a third input."""
    k, n = _k(qtype, 96, 512), 64
    blocks, deq = _weights(qtype, n, k, seed=21)
    kernel = _build(int8_gemv.gemv_kernel(qtype, n, k, None, vnni=True), qtype)
    for batch in (1, 13, 16, 19, 33):
        x = _activations(batch, k, seed=22 + batch)
        _check(kernel(x, blocks, n), x, deq)


def test_vnni_lattice_prefill(emulated):
    """Prefill's VNNI tiles for a lattice format (iq3_s: its grid a third input, each row's
    codes decoded once into a buffer and transposed from there)."""
    k, n = 512, 32
    blocks, deq = _weights("iq3_s", n, k, seed=71)
    func = prefill_kernel("iq3_s", n, k).with_attr("global_symbol", "main")
    with TARGET:
        lib = tvm.compile(tvm.IRModule({"main": func}), TARGET)
    table = tvm.runtime.tensor(np.ascontiguousarray(QUANT_FORMATS["iq3_s"].table()))
    x = _activations(5, k, seed=72)
    out = tvm.runtime.empty((1, 5, n), "float32")
    lib["main"](tvm.runtime.tensor(x.reshape(1, 5, k)), tvm.runtime.tensor(blocks), table, out)
    ref, bound = (a.reshape(5, n) for a in _oracle(x, deq))
    err = np.abs(out.numpy().reshape(5, n) - ref)
    assert (err <= 1e-5 * bound + 1e-6).all(), f"max err {err.max()}"


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_vnni_prefill(emulated, qtype):
    """Prefill's int8 tiles (`int8_prefill`: the VNNI tiles over token rows)."""
    k, n = _k(qtype, 96, 512), 64
    blocks, deq = _weights(qtype, n, k, seed=51)
    func = prefill_kernel(qtype, n, k).with_attr("global_symbol", "main")
    with TARGET:
        lib = tvm.compile(tvm.IRModule({"main": func}), TARGET)
    for tokens in (3, 37):
        x = _activations(tokens, k, seed=52 + tokens)
        out = tvm.runtime.empty((1, tokens, n), "float32")
        lib["main"](tvm.runtime.tensor(x.reshape(1, tokens, k)), tvm.runtime.tensor(blocks), out)
        ref, bound = (a.reshape(tokens, n) for a in _oracle(x, deq))
        err = np.abs(out.numpy().reshape(tokens, n) - ref)
        assert (err <= 1e-5 * bound + 1e-6).all(), f"{tokens} tokens: max err {err.max()}"
