"""Pieces shared by the int8-activation kernels (`cpu.int8_gemv`, `cpu.int8_batched`).

Each activation row is quantized in groups of 32, as llama.cpp's Q8_0 does (`d = max|x| / 127`
per group, codes rounded half away from zero), except for how a group's scale is kept: as an
int16 multiple `m` of one step per row, `unit = max_g d / 32767`:

    m[g] = ceil(d[g] / unit) <= 32767,   q[j] = round(x[j] / (m[g] * unit)),
    x[g*32 + j] ~ q[j] * m[g] * unit.

The kernels need that form: `pmaddwd`, which sums the `pmaddubsw` pairs to int32 anyway,
multiplies them by `m` instead of by ones, so a group costs four vector instructions per
row (two integer multiplies, a convert and an FMA with the weight scale; q8_0's sign trick
adds one), not five (a float `d` needs its own multiply by the weight scale). `unit`
multiplies the row's sum once at the end. Measured at 16 rows on SmolLM2's shapes (best of
15 interleaved rounds, 2 threads), the batched kernel with its quantizing now parallel over
rows: q4_1 gate/up (3072 x 576) 0.466 -> 0.414 ms, q4_1 down (576 x 1536) 0.227 -> 0.174 ms,
the q8_0 head (49152 x 576) 9.0 -> 8.1 ms.

The codes are rounded against the scale actually kept (`m * unit`, at most `d + unit`, so
|q| <= 127), not against `d`: then `m`'s rounding only coarsens the step, by at most 1/m.
Rows with outliers a thousand times their other groups give those groups m ~ 30; codes
rounded against `d` with `m` rounded to nearest had turned that into an error in the scale
itself, which cost 0.5% of q4_0's perplexity through decode (`benchmarks/perplexity.py`).
Buffers:

* `xq[row, k]`: the int8 codes;
* `xm[row, group * 16 : group * 16 + 16]`: `m`, broadcast to the 16 int16 lanes of
  `pmaddwd`'s operand;
* `xr[row]`: `unit`;
* `xs[group * halves + h, row]`: `unit * m * sum(q)` over the group (`halves = 1`) or over
  each 16-activation half (`halves = 2`, the formats whose halves have their own offsets),
  row-minor, so a tile of rows multiplies a weight offset in one vector FMA.

`pmaddwd` stays within int32: a pair of `pmaddubsw` sums is at most 2 * 128 * 127 (q8_0's
sign trick; 2 * 63 * 127 for the widest unsigned codes), times 32767, twice.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..tir_common import add, lanes, maximum, reduce_lanes
from .int8_codes import LANES, codes_of

MULT_LANES = 16  # int16 lanes of xm per group: pmaddwd's second operand
WORD_LANES = 2  # int16 lanes of xm per group, group-major: one word a tile broadcasts
M_MAX = 32767  # the largest group's multiplier
N_CHUNK = 16  # output columns per parallel task
# The one-row kernels' memory access (`int8_vnni_row`'s doc has the measurements): each row's
# cache lines are asked for AHEAD bytes early, into L2 only (`tir_common.STREAM`), and each
# parallel task takes its rows from STREAMS regions of the weight, a row from each in turn,
# so a core follows that many address streams.
AHEAD = 4096  # bytes
STREAMS = 2


def row_streams(n_out: int) -> int:
    """Regions a one-row kernel's tasks take their rows from (1 where they do not split)."""
    return STREAMS if (n_out // N_CHUNK) % STREAMS == 0 else 1


def streamed_row(nc, ni, si, n_out: int, streams: int):
    """The weight row that task `nc` computes as its `ni`-th row of region `si`."""
    return (si * (n_out // N_CHUNK // streams) + nc) * N_CHUNK + ni


def offset_halves(qtype: str) -> int:
    """Activation sums kept per group: 2 for the formats whose halves have their own offsets."""
    return 2 if codes_of(qtype).split_halves else 1


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


def quantize_macro(
    groups: int,
    halves: int,
    group_major: bool = False,
    m_max: int = M_MAX,
    unit_groups: int | None = None,
):
    """A macro quantizing row `r` of `x` ([rows, 1, K]) into xq, xm, xr and xs.

    Two passes over the row's groups: each group's `d` (kept in a per-row scratch buffer, so
    rows can run in parallel), then, once the row's largest `d` is known, the multipliers and
    the codes against the scale they give.

    `group_major`: xq is `[groups, rows, LANES]` and xm `[groups, rows, WORD_LANES]` instead of
    `[rows, K]` and `[rows, groups * MULT_LANES]`, so that a tile walking many rows of one group
    reads them contiguously (`int8_prefill_columns`); `m` is kept twice, one 32-bit word that
    the tile broadcasts to `pmaddwd`'s 16 lanes with a load (`vpbroadcastd`), not 32 bytes.

    `m_max` and `unit_groups`, for kernels that multiply `m` by a weight's integer sub-scale
    in int16 (`int8_kquant_row`): the largest multiplier, and a step per `unit_groups`
    groups instead of per row (`xr[r * units + u]`), so that a smaller `m_max` coarsens only
    the groups under `1 / m_max` of their own super-block's largest, not of the row's.
    """
    span = unit_groups or groups
    units = groups // span

    @T.macro
    def quantize(x, r, xq, xm, xr, xs):
        # plain (global) scope: a small fixed-size buffer becomes a stack array. "local"
        # scope went through TVM's workspace allocator, a call per row (3-15% of the kernels)
        d = T.sblock_alloc_buffer((groups,), "float32")
        qs = T.sblock_alloc_buffer((LANES,), "int32")
        scale = T.sblock_alloc_buffer((2,), "float32")
        for u in range(units):
            scale[1] = T.float32(0)  # the unit's largest d
            for gu in range(span):
                v: T.let[T.float32x32] = x.vload(
                    [r, T.int64(0), (u * span + gu) * LANES], "float32x32"
                )
                d[u * span + gu] = reduce_lanes(magnitude(v, 32), 32, maximum) / T.float32(127)
                scale[1] = T.max(scale[1], d[u * span + gu])
            unit: T.let[T.float32] = scale[1] / T.float32(m_max)
            per_unit: T.let[T.float32] = T.Select(
                scale[1] == T.float32(0), T.float32(0), T.float32(m_max) / scale[1]
            )
            xr[r * units + u] = unit
            for gu in range(span):
                g: T.let[T.int32] = u * span + gu
                m: T.let[T.float32] = T.min(T.ceil(d[g] * per_unit), T.float32(m_max))
                step: T.let[T.float32] = unit * m
                # a buffer, not a let: keeps the shuffles out of the loop below
                scale[0] = T.Select(m == T.float32(0), T.float32(0), T.float32(1) / step)
                for j in T.vectorized(LANES):  # scalar form: TVM's passes are slow on 32-lane
                    qs[j] = T.Cast("int32", round_away(x[r, 0, g * LANES + j] * scale[0], 1))
                q: T.let[T.int32x32] = qs.vload([0], "int32x32")
                if group_major:
                    xq[g, r, T.Ramp(0, 1, LANES)] = T.Cast("int8x32", q)
                    xm[g, r, T.Ramp(0, 1, WORD_LANES)] = T.Broadcast(T.Cast("int16", m), WORD_LANES)
                else:
                    xq[r, T.Ramp(g * LANES, 1, LANES)] = T.Cast("int8x32", q)
                    xm[r, T.Ramp(g * MULT_LANES, 1, MULT_LANES)] = T.Broadcast(
                        T.Cast("int16", m), MULT_LANES
                    )
                if halves == 1:
                    xs[g, r] = step * T.Cast("float32", reduce_lanes(q, 32, add))
                else:
                    xs[g * 2, r] = step * T.Cast(
                        "float32", reduce_lanes(lanes(q, range(16)), 16, add)
                    )
                    xs[g * 2 + 1, r] = step * T.Cast(
                        "float32", reduce_lanes(lanes(q, range(16, 32)), 16, add)
                    )

    return quantize


def dot(codes, xq, xm, signed: bool):
    """8 int32 sums, each of 4 consecutive code * activation products, times `m` (`xm`)."""
    if signed:  # int8 weights: |w| times x with w's sign (pmaddubsw wants one unsigned side)
        xq = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", xq, codes)
        codes = tirx.Cast("uint8x32", tirx.abs(codes))
    pairs = T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", codes, xq)
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, xm)


def code_type(qtype: str):
    return T.int8x32 if codes_of(qtype).signed else T.uint8x32


def lane_scales(lo, hi):
    """8 lanes: the first 4 sums cover weights 0-15 of the group, the last 4 weights 16-31."""
    return tirx.Shuffle(
        [tirx.Broadcast(lo, 4), tirx.Broadcast(hi, 4)], [tirx.const(i, "int32") for i in range(8)]
    )


def sum_lanes(acc, slot: int):
    """The 8 lanes of accumulator `slot` of the local buffer `acc`, added up."""
    return reduce_lanes(acc[tirx.Ramp(slot * 8, 1, 8)], 8, add)
