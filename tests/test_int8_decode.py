"""Int8-activation decode kernels (schedules/cpu/int8_gemv.py and int8_batched.py,
compiler/int8_decode_pass.py).

The oracle is numpy on what the kernel claims to compute: the weights decoded by
`gguf.quants.dequantize`, times the activations rounded as `cpu.int8_ops` documents (written
here again in numpy float32: each group's int16 multiple of a per-row step, the codes
rounded half away from zero against it), summed in float64.
"""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import tvm
from quant_blocks import weight_blocks
from tvm.relax.frontend import nn
from tvm.target import Target

from tallow.compiler.int8_decode_pass import int8_decode_kernels
from tallow.compiler.quant import QUANT_FORMATS, quantize
from tallow.compiler.target import BuildReport, resolve_target
from tallow.model_defs.quant_ops import QuantLinear
from tallow.schedules.cpu import int8_gemv, int8_vnni

# the formats with int8-activation kernels (the TQ types and iq1_m have none: float kernels)
INT8_TYPES = [q for q, f in QUANT_FORMATS.items() if f.int8 is not None]

TARGET = resolve_target("cpu", "f32").tvm()
HAS_VNNI = int8_vnni.supported(TARGET)
needs_vnni = pytest.mark.skipif(not HAS_VNNI, reason="this CPU has no AVX-512 VNNI")

pytestmark = pytest.mark.skipif(not int8_gemv.supported(TARGET), reason="this CPU has no AVX2")


def _weights(qtype: str, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.7 + 0.1
    w[:, ::37] *= 4.0  # heavy-ish tails, and an offset for the formats' mins
    blocks = weight_blocks(w, qtype, seed)  # tallow's quantizer, or random valid blocks
    deq = gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type).reshape(n, k)
    return blocks, deq.astype(np.float64)


def _activations(batch: int, k: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((batch, 1, k)).astype(np.float32) * 3
    x[0, 0, :32] = 0.0  # a group of zeros: scale 0, no division by zero
    # exact halves after scaling (d = 1): gguf rounds them away from zero (2.5 -> 3, not 2)
    x[-1, 0, 32:64] = np.linspace(-15.5, 15.5, 32, dtype=np.float32)
    x[-1, 0, 63] = 127.0
    return x


# The AVX2 one-row kernel of q4k and q5k (`cpu.int8_kquant_row`) multiplies the activation
# multiplier by the 6-bit sub-scale in int16 and sums a super-block's 8 groups in int32:
# m * 63 <= 32767 and 8 groups * 2 pairs * 2 * max_code * 127 * m * 63 < 2**31 give these;
# its step is per super-block (8 groups), not per row.
ROW_M_MAX = {"q4k": 520, "q5k": 270}
M_MAX = 32767


def _row_rounding(qtype: str) -> dict:
    """How `decode`'s AVX2 one-row kernel of `qtype` rounds the activations."""
    return {"m_max": ROW_M_MAX[qtype], "unit_groups": 8} if qtype in ROW_M_MAX else {}


def _round_activations(
    x: np.ndarray, m_max: int = M_MAX, unit_groups: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `x` ([batch, K]) as the kernels round them: (values, per-element step). The
    step is per row, or per `unit_groups` groups."""
    f32 = np.float32
    span = unit_groups or x.shape[-1] // 32
    g = x.astype(f32).reshape(-1, span, 32)  # a row of units
    d = np.abs(g).max(axis=2) / f32(127)
    top = d.max(axis=1, keepdims=True)
    unit = top / f32(m_max)
    per_unit = np.where(top == 0, f32(0), f32(m_max) / np.where(top == 0, f32(1), top))
    m = np.minimum(np.ceil(d * per_unit), f32(m_max)).astype(f32)
    step = unit * m
    inv = np.where(m == 0, f32(0), f32(1) / np.where(m == 0, f32(1), step))
    v = g * inv[:, :, None]
    mag = np.abs(v)
    q = np.copysign(np.floor(mag) + np.floor((mag - np.floor(mag)) * f32(2)), v)
    assert np.abs(q).max() <= 127
    values = q.astype(np.float64) * step[:, :, None]
    return values.reshape(x.shape), np.broadcast_to(step[:, :, None], g.shape).reshape(x.shape)


def _oracle(x: np.ndarray, deq: np.ndarray, **rounding) -> tuple[np.ndarray, np.ndarray]:
    batch, _, k = x.shape
    rounded, _ = _round_activations(x.reshape(batch, k), **rounding)
    bound = np.abs(rounded) @ np.abs(deq).T  # for float32 rounding of the sums
    return (rounded @ deq.T).reshape(batch, 1, -1), bound.reshape(batch, 1, -1)


def test_rounding_is_as_fine_as_q8_0():
    """The rounding the oracle (and the kernels) use: every value within half its step, and
    the step within 1/m of Q8_0's `d`, also in a row whose outliers dwarf its other groups."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[1, 5] = 3000.0  # a massive activation: the other groups get m ~ 30
    x[2, 64:96] = 0.0
    values, step = _round_activations(x)
    assert (np.abs(values - x) <= step / 2 * (1 + 1e-6)).all()
    d = np.abs(x.reshape(3, -1, 32)).max(axis=2, keepdims=True) / 127
    unit = d.max(axis=1, keepdims=True) / 32767
    live = (d > 0).repeat(32, axis=2)
    ratio = (step.reshape(3, -1, 32) / np.where(d > 0, d, 1))[live]
    slack = np.broadcast_to(unit / np.where(d > 0, d, 1), live.shape)[live]
    assert (ratio >= 1 - 1e-6).all() and (ratio <= 1 + slack + 1e-6).all()
    assert (step.reshape(3, -1, 32)[~live] == 0).all()  # the zero group keeps zero codes
    assert slack.max() > 1 / 64  # the outlier row really has groups with small m


def _run(func, x: np.ndarray, blocks: np.ndarray, n: int, qtype: str = "") -> np.ndarray:
    return _build(func, qtype)(x, blocks, n)


def _run_avx2(qtype: str, x: np.ndarray, blocks: np.ndarray, n: int) -> np.ndarray:
    """`decode`'s one-row kernel of `qtype` built for an AVX2-only CPU level, run."""
    from tallow.compiler.cpu_levels import resolve_level

    avx2 = Target(resolve_level("x86-64-v3").tvm_target)
    with avx2:
        func = int8_gemv.gemv_kernel(qtype, n, x.shape[-1], 1)
    return _build(func, qtype, avx2)(x, blocks, n)


def _build(func, qtype: str = "", target=TARGET):
    """`func` compiled, as call(x, blocks, n); `qtype`'s table (a lattice i-quant's grid)
    passed where the kernel takes one."""
    with target:
        lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    table = QUANT_FORMATS[qtype].table if qtype and QUANT_FORMATS[qtype].table else None
    tables = [tvm.runtime.tensor(np.ascontiguousarray(table()))] if table else []

    def call(x: np.ndarray, blocks: np.ndarray, n: int) -> np.ndarray:
        out = tvm.runtime.empty((x.shape[0], 1, n), "float32")
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(blocks), *tables, out)
        return out.numpy()

    return call


def _check(got: np.ndarray, x: np.ndarray, deq: np.ndarray, **rounding) -> None:
    ref, bound = _oracle(x, deq, **rounding)
    err = np.abs(got - ref)
    assert (err <= 1e-5 * bound + 1e-6).all(), f"batch {x.shape[0]}: max err {err.max()}"
    # not the float-activation product: the rounding of x is really there
    float_ref = x.astype(np.float64).reshape(x.shape[0], -1) @ deq.T
    assert np.abs(got.reshape(float_ref.shape) - float_ref).max() > 1e-3


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_gemv_matches_numpy(qtype):
    """Every format, one static row (`decode`): the single-row kernel. 96 rows are 6 tasks
    of 16, which take their rows from two regions of the weight (`int8_ops.streamed_row`)."""
    k = 96 if QUANT_FORMATS[qtype].block_size == 32 else 512
    n = 96
    blocks, deq = _weights(qtype, n, k, seed=1)
    x = _activations(1, k, seed=2)
    got = _run(int8_gemv.gemv_kernel(qtype, n, k, 1), x, blocks, n, qtype)
    _check(got, x, deq, **_row_rounding(qtype))


@pytest.mark.parametrize("qtype", ["q4_0", "q4k"])
def test_row_kernel_with_one_region(qtype):
    """48 rows are 3 tasks of 16, which do not split in two regions: rows in plain order
    (the legacy and the K-quant AVX2 kernels)."""
    k, n = 512, 48
    blocks, deq = _weights(qtype, n, k, seed=3)
    x = _activations(1, k, seed=4)
    got = _run(int8_gemv.gemv_kernel(qtype, n, k, 1), x, blocks, n, qtype)
    _check(got, x, deq, **_row_rounding(qtype))


@needs_vnni
@pytest.mark.parametrize(
    ("qtype", "k"),
    [
        ("q8_0", 704),  # signed codes; 16-group steps with a tail of 6 groups (3 pairs)
        ("q4_1", 704),  # legacy nibbles and mins
        ("q5_0", 704),  # and fifth bits
        ("q5_1", 1024),  # whole 16-group steps: the last one outside the loop
        ("q4_0", 64),  # a row shorter than the 64-byte window: codes gathered from parts
        ("q3k", 512),  # a K-quant without vector block scales: scales per pair
        ("q4k", 512),  # nibble pairs from one load; two super-blocks' scales at once
        ("q6k", 768),  # halves with their own scales; an odd count of super-blocks
        ("iq4_xs", 768),  # table nibbles (`int8_table_row`): an odd count of super-blocks
        ("iq4_xs", 1024),  # two super-blocks' scales at once
        ("iq3_s", 768),  # grid entries gathered, signs on the activations (`int8_grid_row`)
    ],
)
def test_vnni_row_kernel_matches_numpy(qtype, k):
    """One static row on an AVX-512 VNNI CPU (`cpu.int8_vnni_row`), each of its code paths."""
    n = 32
    blocks, deq = _weights(qtype, n, k, seed=31)
    x = _activations(1, k, seed=32)
    _check(_run(int8_gemv.gemv_kernel(qtype, n, k, 1, vnni=True), x, blocks, n, qtype), x, deq)


@pytest.mark.parametrize("qtype", ["q2k", "q4k", "q5k", "q6k"])
def test_block_scales_row_kernel_on_avx2(qtype):
    """The K-quants' one-row kernel (a super-block's scales decoded as one vector,
    `Int8Codes.block_scales`) built for an AVX2-only CPU level (no 512-bit vectors: its
    16-lane scale vectors split in two), 3 super-blocks a row."""
    assert QUANT_FORMATS[qtype].int8.block_scales is not None
    k, n = 768, 32
    blocks, deq = _weights(qtype, n, k, seed=11)
    x = _activations(1, k, seed=12)
    _check(_run_avx2(qtype, x, blocks, n), x, deq, **_row_rounding(qtype))


@pytest.mark.parametrize("qtype", sorted(ROW_M_MAX))
def test_kquant_row_kernel_at_its_limits(qtype):
    """The AVX2 one-row kernel of q4k / q5k at the worst case its multiplier limit allows:
    every code and sub-scale at its largest (all scale bytes 0xff: 63), every activation
    code at +-127 with every group's multiplier at the limit. One int32 lane then holds
    8 groups x 2 pairs x 2 x max_code x 127 x m x 63, within 1% of 2**31 for q4k; a limit
    set any higher would wrap and fail the comparison."""
    from tallow.schedules.cpu import int8_kquant_row

    assert int8_kquant_row.multiplier_limit(qtype) == ROW_M_MAX[qtype]
    fmt = QUANT_FORMATS[qtype]
    k, n = 512, 32
    blocks = np.full((n, k // 256 * fmt.type_size), 0xFF, np.uint8)
    header = np.array([1.0, 0.5], np.float16).view(np.uint8)  # d, dmin
    for b in range(k // 256):
        blocks[:, b * fmt.type_size : b * fmt.type_size + 4] = header
    deq = gguf.quants.dequantize(blocks, fmt.ggml_type).reshape(n, k).astype(np.float64)
    x = np.ones((1, 1, k), np.float32)
    x[0, 0, 256:352] = -1.0  # three groups of the second super-block negative
    ref, _ = _oracle(x, deq, **_row_rounding(qtype))  # +-1 rounds exactly: x @ deq^T
    assert np.abs(ref).min() > 1000
    np.testing.assert_allclose(_run_avx2(qtype, x, blocks, n), ref, rtol=1e-6)


@pytest.mark.parametrize("qtype", ["iq4_xs", "iq3_s"])
@pytest.mark.parametrize("k", [256, 768, 1024])
def test_i_quant_row_kernels_on_avx2(qtype, k):
    """The i-quants' one-row kernels for an AVX2-only CPU level, whatever this CPU:
    iq4_xs's (`int8_table_row.avx2_dot_macro`: 32-byte nibble loads, activations reordered
    by half groups) and iq3_s's (`int8_grid_row`: a 256-bit gather per group, the signs on
    the activations); 1, 3 (odd) and 4 super-blocks a row."""
    n = 32
    blocks, deq = _weights(qtype, n, k, seed=13)
    x = _activations(1, k, seed=14)
    _check(_run_avx2(qtype, x, blocks, n), x, deq)


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_batched_matches_numpy(qtype):
    """Every format, a symbolic batch (`batch_decode`, the tiled kernel of
    `cpu.int8_batched`), run at sizes that exercise whole 8-row tiles, 4-row tail tiles
    and padded rows: 1, 4, 5, 8, 13 (8 + 4 + 1); the formats with column tiles
    (`cpu.int8_columns`) take those at every size: one partial tile up to 13 sequences, and
    one of 16 then one of 3 at 19."""
    k, n = _batched_shape(qtype)
    blocks, deq = _weights(qtype, n, k, seed=1)
    kernel = _batched_kernel(qtype)
    for batch in (1, 4, 5, 8, 13, 19):
        x = _activations(batch, k, seed=2 + batch)
        _check(kernel(x, blocks, n), x, deq)


def _batched_shape(qtype: str) -> tuple[int, int]:
    return (96 if QUANT_FORMATS[qtype].block_size == 32 else 512), 48


@functools.cache
def _batched_kernel(qtype: str, vnni: bool = False):
    """`batch_decode`'s kernel (a symbolic batch) for `qtype` at `_batched_shape`."""
    k, n = _batched_shape(qtype)
    return _build(int8_gemv.gemv_kernel(qtype, n, k, None, vnni=vnni), qtype)


@pytest.mark.parametrize("vnni", [False, pytest.param(True, marks=needs_vnni)])
@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_batched_rows_do_not_depend_on_the_batch(qtype, vnni):
    """`--deterministic` (docs/cpu-kernels.md#deterministic-mode): row r of a batch of B, for
    B from 1 to 17, equals row r alone, bit for bit, through `batch_decode`'s kernel: the AVX2
    tiles (row tiles: 8-row tiles, 4-row tails, padded rows; column tiles: one or two 16-row
    tiles), and the AVX-512 VNNI tiles on CPUs that have them. Until the AVX2 column tiles
    served every batch size, they took over from 8 sequences (12 for q5k and q6k) and summed
    a row in another order than the row tiles below that size."""
    k, n = _batched_shape(qtype)
    blocks, _ = _weights(qtype, n, k, seed=41)
    x = _activations(17, k, seed=42)
    kernel = _batched_kernel(qtype, vnni)
    alone = np.concatenate([kernel(x[r : r + 1], blocks, n) for r in range(17)]).view(np.uint32)
    differ = [
        b
        for b in range(1, 18)
        if not np.array_equal(kernel(x[:b], blocks, n).view(np.uint32), alone[:b])
    ]
    assert not differ, f"batches whose rows differ from the rows alone: {differ}"


@needs_vnni
@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_vnni_tiles_match_numpy(qtype):
    """Every format through `cpu.int8_vnni`'s 16-column tiles (what `batch_decode` runs on
    CPUs with AVX-512 VNNI; a lattice format's grid a third input): one partial tile (1, 4,
    13 sequences), a whole one (16), whole ones and a rest (19, 33), and 64 output columns:
    four 16-column blocks."""
    k = 96 if QUANT_FORMATS[qtype].block_size == 32 else 512
    n = 64
    blocks, deq = _weights(qtype, n, k, seed=21)
    kernel = _build(int8_gemv.gemv_kernel(qtype, n, k, None, vnni=True), qtype)
    for batch in (1, 4, 13, 16, 19, 33):
        x = _activations(batch, k, seed=22 + batch)
        _check(kernel(x, blocks, n), x, deq)


@pytest.mark.parametrize("qtype", ["q4_1", "q6k"])
def test_row_tiles_without_column_tiles(qtype):
    """The row tiles of formats that take the column tiles at every batch size (kept for
    benchmarks: `column_tiles=False`); their 8-row tiles otherwise run only for the formats
    without column tiles."""
    k = 96 if QUANT_FORMATS[qtype].block_size == 32 else 512
    n = 48
    blocks, deq = _weights(qtype, n, k, seed=5)
    kernel = _build(int8_gemv.gemv_kernel(qtype, n, k, None, column_tiles=False))
    for batch in (8, 13):
        x = _activations(batch, k, seed=6 + batch)
        _check(kernel(x, blocks, n), x, deq)


@pytest.mark.parametrize("qtype", [q for q in INT8_TYPES if QUANT_FORMATS[q].quantize_blocks])
def test_batched_at_extreme_codes(qtype):
    """(The formats tallow writes: the extreme codes are quantized here.) Weight groups at
    their largest codes against full-scale activations of the same signs: the sums reach
    the int16 and int32 bounds the kernels add within (every group's multiplier is the
    largest, 32767). An overflow would show as a huge error. Both the row
    tiles (5 sequences) and, where the format has them, the column tiles (16); on CPUs with
    AVX-512 VNNI its tiles too (q8_0's -128 and 127 are its flipped codes' ends)."""
    k = 96 if QUANT_FORMATS[qtype].block_size == 32 else 512
    n = 16
    rng = np.random.default_rng(11)
    signs = rng.choice([-1.0, 1.0], size=(4, k))
    patterns = [np.ones(k), -np.ones(k), signs[0], signs[1]]
    w = np.stack([patterns[i % 4] for i in range(n)]).astype(np.float32)
    w[4:8, ::32] = 0.0  # offset formats: one low weight per group puts the rest at the top
    w[12:, 5::32] = 0.0
    blocks = quantize(w, qtype)
    deq = gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type).reshape(n, k)
    kernels = {"avx2": _build(int8_gemv.gemv_kernel(qtype, n, k, None), qtype)}
    if HAS_VNNI:
        kernels["vnni"] = _build(int8_gemv.gemv_kernel(qtype, n, k, None, vnni=True), qtype)
    for name, kernel in kernels.items():
        for batch in (5, 16):
            x = np.stack([patterns[i % 4] * (1 - 2 * (i // 4 % 2)) for i in range(batch)])
            x = x.astype(np.float32).reshape(batch, 1, k) * 3
            ref, bound = _oracle(x, deq.astype(np.float64))
            got = kernel(x, blocks, n)
            assert (np.abs(got - ref) <= 1e-5 * bound + 1e-6).all(), f"{name}, batch {batch}"


def test_batched_static_size():
    """A static batch larger than one goes to the tiled kernel too."""
    k, n, qtype = 64, 32, "q4_1"
    blocks, deq = _weights(qtype, n, k, seed=3)
    x = _activations(6, k, seed=4)
    _check(_run(int8_gemv.gemv_kernel(qtype, n, k, 6), x, blocks, n), x, deq)


def test_shapes_it_cannot_tile_are_refused():
    with pytest.raises(ValueError, match="k % 32"):
        int8_gemv.gemv_kernel("q4_0", 48, 40, 1)
    with pytest.raises(ValueError, match="n % 16"):
        int8_gemv.gemv_kernel("q4_0", 40, 64, 1)


def test_supported_targets():
    assert int8_gemv.supported(Target({"kind": "llvm", "mcpu": "haswell"}))
    assert not int8_gemv.supported(Target({"kind": "llvm", "mcpu": "sandybridge"}))
    assert not int8_gemv.supported(
        Target({"kind": "llvm", "mtriple": "arm64-apple-macos", "mcpu": "apple-m1"})
    )
    assert not int8_gemv.supported(None)
    assert int8_vnni.supported(Target({"kind": "llvm", "mcpu": "znver4"}))
    assert int8_vnni.supported(Target({"kind": "llvm", "mcpu": "sapphirerapids"}))
    assert not int8_vnni.supported(Target({"kind": "llvm", "mcpu": "znver3"}))
    assert not int8_vnni.supported(Target({"kind": "llvm", "mcpu": "haswell"}))
    assert not int8_vnni.supported(None)


class _Projections(nn.Module):
    def __init__(self, k, n, qtype):
        self.proj = QuantLinear(k, n, qtype)

    def decode(self, x):
        return self.proj(x)

    batch_decode = prefill = rows = decode


def test_pass_replaces_decode_kernels_only():
    """One token per sequence ([1, 1, K], [b, 1, K]) gets the int8 kernel; a prefill
    ([1, s, K]) and a 2-D input keep the float dequantize-matmul."""
    k, n, qtype = 64, 32, "q4_1"
    specs = {
        "decode": {"x": nn.spec.Tensor([1, 1, k], "float32")},
        "batch_decode": {"x": nn.spec.Tensor(["b", 1, k], "float32")},
        "prefill": {"x": nn.spec.Tensor([1, "s", k], "float32")},
        "rows": {"x": nn.spec.Tensor(["m", k], "float32")},
    }
    mod, _ = _Projections(k, n, qtype).export_tvm(specs)
    report = BuildReport()
    with TARGET:
        out = int8_decode_kernels(report)(mod)
    int8 = [f for _, f in out.functions_items() if 'T.sblock("quantize")' in f.script()]
    floats = [f for _, f in out.functions_items() if "dequantize" in f.script()]
    assert len(int8) == 2 and len(floats) == 2
    assert all(int(f.attrs["op_pattern"]) == 8 for f in int8)  # opaque: fusion leaves it whole
    assert report.to_details() == {
        "decode_activations": "int8_g32_row_step",
        "int8_decode_kernels": 2,
        "int8_decode_tiles": "avx2",
    }


def test_pass_gives_a_lattice_type_the_row_kernels():
    """An IQ3_S projection (its grid a constant third input): `decode` and `batch_decode` get
    the int8 kernels, taking the table as the fused kernel did; prefill is the prefill pass's
    (`test_int8_prefill.py`). Their numbers: `test_gemv_matches_numpy`,
    `test_batched_matches_numpy`."""
    k, n, qtype = 512, 32, "iq3_s"
    specs = {
        "decode": {"x": nn.spec.Tensor([1, 1, k], "float32")},
        "batch_decode": {"x": nn.spec.Tensor(["b", 1, k], "float32")},
        "prefill": {"x": nn.spec.Tensor([1, "s", k], "float32")},
    }
    mod, _ = _Projections(k, n, qtype).export_tvm(specs)
    report = BuildReport()
    with TARGET:
        out = int8_decode_kernels(report)(mod)
    int8 = [f for _, f in out.functions_items() if 'T.sblock("quantize")' in f.script()]
    floats = [f for _, f in out.functions_items() if "dequantize" in f.script()]
    assert len(int8) == 2 and len(floats) == 1
    assert all(len(f.params) == 4 for f in int8)  # x, w, table, out
    assert report.int8_decode_kernels == 2


@pytest.mark.slow
def test_decode_logits_close_to_prefill(tiny_model_dir, tmp_path):
    """A quantized tiny model: the logits of a decode step (int8 activations) stay within
    the activation rounding of the same token's logits from prefill (float activations),
    and the manifest says which activations decode uses."""
    import yaml

    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    src = tiny_model_dir("qwen3")
    art = compile_model(CompileOptions(model=str(src), quant="q4_0", output=tmp_path, quiet=True))
    (library,) = yaml.safe_load((art / "manifest.yaml").read_text())["libraries"]
    details = library["details"]
    assert details["decode_activations"] == "int8_g32_row_step"
    assert details["int8_decode_kernels"] > 0
    runner = TVMModelRunner(art, kv=KVCacheConfig(2, 256, 16))
    prompt = [5, 17, 40, 3, 99, 250, 7, 31]
    for seq in (0, 1):
        runner.add_sequence(seq)
    whole = runner.forward([(0, prompt)])[0]  # prefill: every token with float activations
    runner.forward([(1, prompt[:-1])])
    stepped = runner.forward([(1, prompt[-1:])])[0]  # the last token as a decode step
    assert not np.array_equal(whole, stepped)  # different kernels really ran
    assert np.abs(whole - stepped).max() <= 0.05 * np.abs(whole).max()
