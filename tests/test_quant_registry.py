"""The quant format registry: one table that every layer reads, and a format added in one place.

Part 1 checks that the registered formats agree with the GGUF reader, the CLI, the `--quant`
plan and the `gguf` package. Part 2 defines a made-up format in this module only (`q8x16`:
16 weights, an f16 scale and 16 int8 codes) and runs it through quantize / dequantize, the
quant plan and the fused dequantize-matmul of `model_defs.quant_ops` compiled for LLVM: that
a new format needs nothing outside its own module.
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import tvm
from tvm import te
from tvm.target import Target

from tallow.cli.main import main, quant_format_names
from tallow.compiler.gguf_source import supported_types
from tallow.compiler.int8_decode_pass import int8_kernel_for
from tallow.compiler.quant import (
    QUANT_FORMATS,
    QuantFormat,
    dequantize,
    format_for_ggml_type,
    get_format,
    quantize,
    register_format,
    unregister_format,
)
from tallow.compiler.quant.tir_bytes import f32, half, signed
from tallow.compiler.quant_plan import check_quant_option, make_plan, quant_choices
from tallow.model_defs.quant_ops import QUANT_TYPE_ATTR, dequantize_te, quant_matmul_te, row_bytes
from tallow.runtime.errors import TargetError
from tallow.schedules.cpu import quant as cpu_quant

GGML = gguf.GGMLQuantizationType

# ------------------------------------------------------------------- every format, every layer


def test_gguf_reader_accepts_exactly_the_registered_types():
    blocks = {f.ggml_type for f in QUANT_FORMATS.values() if f.ggml_type is not None}
    assert supported_types() == {GGML.F32, GGML.F16, GGML.BF16} | blocks
    for fmt in QUANT_FORMATS.values():
        assert format_for_ggml_type(fmt.ggml_type) is fmt
    assert format_for_ggml_type(GGML.F16) is None


def test_cli_quant_names_are_the_registry(capsys):
    names = quant_format_names()
    assert names[:3] == ("f32", "f16", "bf16") and quant_choices() == names
    # every registered format can be asked for alone (FORMAT:all), and names a mix too
    writable = [f for f, fmt in QUANT_FORMATS.items() if fmt.quantize_blocks is not None]
    assert {f"{f}:all" for f in writable} <= set(names)
    assert all(f in names for f in writable)
    assert not {f for f in QUANT_FORMATS if f not in writable} & set(names)
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert ", ".join(quant_format_names()) in help_text


@pytest.mark.parametrize("name", list(QUANT_FORMATS))
def test_format_is_consistent(name):
    fmt = QUANT_FORMATS[name]
    assert fmt.name == name and get_format(name) is fmt
    assert gguf.GGML_QUANT_SIZES[fmt.ggml_type] == (fmt.block_size, fmt.type_size)
    assert fmt.bits_per_weight == fmt.type_size * 8 / fmt.block_size
    if fmt.fallback is not None:
        fallback = get_format(fmt.fallback)
        assert fmt.block_size % fallback.block_size == 0
        assert fallback.block_size < fmt.block_size
    if fmt.int8 is not None:
        assert fmt.block_size % 32 == 0  # the int8 kernels work in groups of 32 weights
        if fmt.int8.column_tiles:  # column tiles size their int16 sums by the largest code
            assert fmt.int8.max_code is not None or fmt.table is not None  # (or the grid's)
    if fmt.quantize_blocks is None:  # read only: `--quant` refuses it, saying why
        assert fmt.no_quantizer
        with pytest.raises(TargetError, match=re.escape(fmt.no_quantizer)):
            check_quant_option(name, "f32")
    else:
        check_quant_option(name, "f32")


def test_registry_errors():
    with pytest.raises(ValueError, match="valid names: q8_0, q4_0"):
        get_format("q4_k")
    with pytest.raises(ValueError, match="already registered"):
        register_format(QUANT_FORMATS["q4_0"])
    with pytest.raises(ValueError, match="q2k, q3k, tq1_0, tq2_0 fall back to it"):
        unregister_format("q4_0")


# ------------------------------------------------------------- a made-up format, in one place

BLOCK = 16
TYPE_SIZE = 18  # d:f16 @0, qs:int8[16] @2; w = d * q


def _quantize_q8x16(x: np.ndarray) -> np.ndarray:
    d = (np.abs(x).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float16)
    inv = np.divide(1.0, d.astype(np.float32), out=np.zeros_like(x[:, :1]), where=d != 0)
    q = np.clip(np.rint(x * inv), -127, 127).astype(np.int8)
    return np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=1)


def _dequantize_q8x16(b: np.ndarray) -> np.ndarray:
    d = np.ascontiguousarray(b[:, :2]).view(np.float16).astype(np.float32)
    return d * np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)


def _tir_q8x16(byte, j):
    return half(byte, 0) * f32(signed(byte(2 + j)))


Q8X16 = QuantFormat(
    name="q8x16",
    ggml_type=None,  # not a GGUF type: the reader keeps refusing it
    block_size=BLOCK,
    type_size=TYPE_SIZE,
    quantize_blocks=_quantize_q8x16,
    dequantize_blocks=_dequantize_q8x16,
    tir_decode=_tir_q8x16,
    fallback=None,  # nothing smaller than 16: a row of another length stays float
    int8=None,  # no int8-activation decode kernels: decode keeps the fused float kernel
)


@pytest.fixture
def q8x16():
    register_format(Q8X16)
    try:
        yield Q8X16
    finally:
        unregister_format(Q8X16.name)


def _weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)


def test_made_up_format_numpy_round_trip(q8x16):
    x = _weights(6, 48)
    blocks = quantize(x, "q8x16")
    assert blocks.shape == (6, 48 // BLOCK * TYPE_SIZE) and blocks.dtype == np.uint8
    back = dequantize(blocks, "q8x16", x.shape)
    np.testing.assert_array_equal(back, _dequantize_q8x16(blocks.reshape(-1, 18)).reshape(6, 48))
    step = np.abs(x).reshape(-1, BLOCK).max(axis=1) / 127
    assert np.all(np.abs(back - x).reshape(-1, BLOCK) <= step[:, None] * 0.51 + 1e-6)
    with pytest.raises(ValueError, match="block size 16"):
        quantize(_weights(2, 40), "q8x16")


def test_made_up_format_in_the_quant_plan(q8x16):
    assert "q8x16" in quant_choices()
    check_quant_option("q8x16", "f32")
    weight_map = {
        "layers.0.o_proj.weight": ["o"],  # 48 columns: whole blocks of 16
        "layers.0.down_proj.weight": ["down"],  # 40 columns: no fallback, stays float
        "layers.0.input_layernorm.weight": ["norm"],  # never quantized
    }
    shapes = {"o": (32, 48), "down": (32, 40), "norm": (48,)}
    plan = make_plan("q8x16", "f32", weight_map, shapes.__getitem__, lambda _: "float")
    assert plan.label == "q8x16"
    assert plan.types == {"layers.0.o_proj.weight": "q8x16"}


def test_made_up_format_gone_after_the_fixture():
    assert "q8x16" not in QUANT_FORMATS and "q8x16" not in quant_choices()


def test_made_up_format_fused_matmul_on_llvm(q8x16):
    """`model_defs.quant_ops`' dequantize and dequantize-matmul, compiled for LLVM, against
    the numpy decoder and a numpy matmul."""
    rows, cols, batch = 24, 64, 3
    w_np = quantize(_weights(rows, cols, seed=1), "q8x16")
    x_np = _weights(batch, cols, seed=2)
    ref_w = dequantize(w_np, "q8x16", (rows, cols))
    target = Target({"kind": "llvm"})

    w = te.placeholder((rows, row_bytes("q8x16", cols)), "uint8", name="w")
    deq = tvm.compile(
        tvm.IRModule({"main": te.create_prim_func([w, dequantize_te(w, "q8x16", rows, cols)])}),
        target=target,
    )
    out = tvm.runtime.empty((rows, cols), "float32")
    deq["main"](tvm.runtime.tensor(w_np), out)
    np.testing.assert_array_equal(out.numpy(), ref_w)

    # the decode-shaped kernel as the model emits it: [batch, 1, K] activations, tagged
    x = te.placeholder((batch, 1, cols), "float32", name="x")
    y = quant_matmul_te(x, w, "q8x16", rows, "float32")
    func = te.create_prim_func([x, w, y]).with_attr(QUANT_TYPE_ATTR, "q8x16")
    assert int8_kernel_for(func) is None  # no int8 groups: it keeps the float kernel
    scheduled = cpu_quant.schedule_func(func, target)  # the CPU schedule of that kernel
    assert scheduled is not None
    for kernel in (func, scheduled):
        mm = tvm.compile(tvm.IRModule({"main": kernel}), target=target)
        out = tvm.runtime.empty((batch, 1, rows), "float32")
        mm["main"](tvm.runtime.tensor(x_np[:, None, :]), tvm.runtime.tensor(w_np), out)
        np.testing.assert_allclose(out.numpy()[:, 0], x_np @ ref_w.T, rtol=1e-5, atol=1e-5)
