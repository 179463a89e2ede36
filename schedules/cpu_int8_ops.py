"""Pieces shared by the int8-activation kernels (`cpu_int8_gemv`, `cpu_int8_batched`).

The activations are quantized per 32 as llama.cpp's Q8_0 (`d = max|x| / 127`,
`q = round(x / d)` half away from zero, `d` kept as f16) into three buffers:

* `xq[row, k]`: the int8 codes;
* `xd[row, group * 8 : group * 8 + 8]`: the group's `d`, broadcast to 8 lanes, so that its
  product with a weight scale is one vector multiply with a memory operand (a scalar `d`
  becomes a scalar multiply and a register broadcast per use in LLVM's hands);
* `xs[group * halves + h, row]`: `d * sum(q)` over the group (`halves = 1`) or over each
  16-activation half (`halves = 2`, the formats whose halves have their own offsets),
  row-minor, so a tile of rows multiplies a weight offset in one vector FMA.

A group of 32 weight codes times 32 int8 activations is one `pmaddubsw` (pairwise sums to
16 int16) and one `pmaddwd` (to 8 int32): `dot`.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .cpu_int8_codes import LANES, SIGNED, SPLIT_HALVES
from .tir_vectors import add, lanes, reduce_lanes

SCALE_LANES = 8  # lanes of xd per group: one AVX2 float vector
N_CHUNK = 16  # output columns per parallel task


def offset_halves(qtype: str) -> int:
    """Activation sums kept per group: 2 for the formats whose halves have their own offsets."""
    return 2 if qtype in SPLIT_HALVES else 1


def _vec(dtype: str, count: int) -> str:
    return dtype if count == 1 else f"{dtype}x{count}"


def magnitude(v, count: int):
    """|v| of float32 lanes, by clearing the sign bits (see `round_away`)."""
    bits = tirx.reinterpret(_vec("int32", count), v) & tirx.const(0x7FFFFFFF, "int32")
    return tirx.reinterpret(_vec("float32", count), bits)


def round_away(v, count: int):
    """Round half away from zero, as `gguf`'s (and llama.cpp's reference) Q8_0 quantizer.

    |v| and the sign are taken from the bits: `abs` and a select on a 32-lane vector made
    TVM's TIR passes take 7 s per kernel.
    """
    bits = tirx.reinterpret(_vec("int32", count), v)
    mag = magnitude(v, count)
    whole = tirx.floor(mag)
    r = whole + tirx.floor((mag - whole) * 2.0)
    sign = bits & tirx.const(-(2**31), "int32")
    return tirx.reinterpret(
        _vec("float32", count), tirx.reinterpret(_vec("int32", count), r) | sign
    )


def quantize_macro(halves: int):
    """A macro quantizing group `g` of row `r` of `x` ([rows, 1, K]) into xq, xd and xs."""

    @T.macro
    def quantize(x, r, g, xq, xd, xs):
        v: T.let[T.float32x32] = x.vload([r, T.int64(0), g * LANES], "float32x32")
        d: T.let[T.float32] = reduce_lanes(magnitude(v, 32), 32, T.max) / T.float32(127)
        inv: T.let[T.float32] = T.Select(d == T.float32(0), T.float32(0), T.float32(1) / d)
        qs = T.sblock_alloc_buffer((LANES,), "int32", scope="local")
        scale = T.sblock_alloc_buffer((1,), "float32", scope="local")
        scale[0] = inv  # a buffer, not a let: keeps the shuffles out of the loop below
        for j in T.vectorized(LANES):  # scalar form: TVM's passes are slow on 32-lane
            qs[j] = T.Cast("int32", round_away(x[r, 0, g * LANES + j] * scale[0], 1))
        q: T.let[T.int32x32] = qs.vload([0], "int32x32")
        xq[r, T.Ramp(g * LANES, 1, LANES)] = T.Cast("int8x32", q)
        dh: T.let[T.float32] = T.Cast("float32", T.Cast("float16", d))
        xd[r, T.Ramp(g * SCALE_LANES, 1, SCALE_LANES)] = T.Broadcast(dh, SCALE_LANES)
        if halves == 1:
            xs[g, r] = dh * T.Cast("float32", reduce_lanes(q, 32, add))
        else:
            xs[g * 2, r] = dh * T.Cast("float32", reduce_lanes(lanes(q, range(16)), 16, add))
            xs[g * 2 + 1, r] = dh * T.Cast(
                "float32", reduce_lanes(lanes(q, range(16, 32)), 16, add)
            )

    return quantize


def dot(codes, xq, signed: bool):
    """8 int32 sums, each of 4 consecutive code * activation products."""
    if signed:  # int8 weights: |w| times x with w's sign (pmaddubsw wants one unsigned side)
        xq = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", xq, codes)
        codes = tirx.Cast("uint8x32", tirx.abs(codes))
    pairs = T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", codes, xq)
    ones = tirx.Broadcast(tirx.const(1, "int16"), 16)
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, ones)


def code_type(qtype: str):
    return T.int8x32 if qtype in SIGNED else T.uint8x32


def lane_scales(lo, hi):
    """8 lanes: the first 4 sums cover weights 0-15 of the group, the last 4 weights 16-31."""
    return tirx.Shuffle(
        [tirx.Broadcast(lo, 4), tirx.Broadcast(hi, 4)], [tirx.const(i, "int32") for i in range(8)]
    )


def sum_lanes(acc, slot: int):
    """The 8 lanes of accumulator `slot` of the local buffer `acc`, added up."""
    return reduce_lanes(acc[tirx.Ramp(slot * 8, 1, 8)], 8, add)
