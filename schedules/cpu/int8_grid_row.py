"""`decode`'s one-row kernels for the lattice format with 4-byte grid entries and a sign bit
per weight (iq3_s, most of an IQ3_M file), on AVX-512 VNNI and on AVX2.

The generic AVX2 row kernel (`int8_gemv._row_kernel` on `grids.int8_groups.iq3_s`) builds
each 32-weight group from scalar work: 8 grid indices from a low byte and a high bit each,
8 4-byte table loads joined into a vector, the signs applied to the values, then q8_0's
sign trick takes them off again for `pmaddubsw`. Here, per step of `count` groups (2 on
VNNI: one `vpdpbusd`; 1 on AVX2):

* the grid indices are computed as one vector (`GridCodes.indices`) and their entries
  fetched by one `vpgatherdd` (the grid values, 1..15, unsigned as they are);
* the sign bits go onto the activations instead of the weights: the sign bytes spread to
  one byte per weight, tested against each byte's bit, and the activations negated where it
  is set (|activation| <= 127, so the negation is exact). No offset, no flip, no sign trick;
* the block's 8 group scales are decoded as one vector (`GridCodes.group_scales`) times
  `xmf` (each group's activation multiplier, as float: AVX2's `pmaddwd` multiplies by ones);
* a row's cache lines are asked for `int8_ops.AHEAD` bytes ahead into L2 and each task
  follows two streams, as `int8_vnni_row` does (without them one VNNI thread read 4.7 GB/s
  of iq3_s weights).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from ..tir_common import STREAM, add, prefetch, reduce_lanes
from .int8_codes import LANES, Row, codes_of
from .int8_ops import AHEAD, MULT_LANES, N_CHUNK, dot, quantize_macro, row_streams, streamed_row
from .int8_vnni import COLS, _vpdpbusd

PAIR = 2 * LANES
# byte i of a spread sign vector is tested against bit i % 8
_BIT_OF_LANE = int.from_bytes(bytes(1 << i for i in range(8)), "little", signed=True)


def _c(i: int):
    return tirx.const(i, "int32")


def applies(qtype: str, k: int) -> bool:
    """Whether `qtype` has these kernels (`Int8Codes.grid_codes`) and rows of `k` split into
    its blocks."""
    fmt = get_format(qtype)
    return codes_of(qtype).grid_codes is not None and k % fmt.block_size == 0


def _gather(table, indices):
    """int32x16: the 4-byte grid entries at `indices` of the uint8 `table` (`vpgatherdd` on
    512 bits)."""
    return T.call_llvm_intrin(
        "int32x16",
        "llvm.x86.avx512.gather.dpi.512",
        tirx.Broadcast(_c(0), COLS),
        T.address_of(table[0]),
        indices,
        tirx.const(-1, "int16"),
        _c(4),
    )


def _gather_avx2(table, indices):
    """int32x8: `_gather` on 256 bits."""
    return T.call_llvm_intrin(
        "int32x8",
        "llvm.x86.avx2.gather.d.d.256",
        tirx.Broadcast(_c(0), 8),
        T.address_of(table[0]),
        indices,
        tirx.Broadcast(_c(-1), 8),
        tirx.const(4, "int8"),
    )


def _signed(x, sign_bytes, weights: int):
    """int8 x `weights` activations `x` negated where the weight's sign bit is set (bit j of
    `sign_bytes`, byte j // 8)."""
    spread = tirx.Shuffle([sign_bytes] * 8, [_c(i // 8) for i in range(weights)])  # (no widening)
    bit = tirx.reinterpret(
        f"uint8x{weights}", tirx.Broadcast(tirx.const(_BIT_OF_LANE, "int64"), weights // 8)
    )
    negative = tirx.NE(spread & bit, tirx.Broadcast(tirx.const(0, "uint8"), weights))
    return tirx.Select(negative, tirx.Broadcast(tirx.const(0, "int8"), weights) - x, x)


def _step_vnni(table, codes, row, g, x):
    """int32x16: groups g, g + 1 of `row` times activations `x` (int8x64), lane i: weights
    4i..4i+3."""
    return _vpdpbusd(
        tirx.Broadcast(_c(0), COLS),
        tirx.reinterpret("uint8x64", _gather(table, codes.indices(row, g, 2))),
        _signed(x, row.vec(codes.signs_at + 4 * g, 8), PAIR),
    )


def _step_avx2(table, codes, row, g, x):
    """int32x8: group g of `row` times activations `x` (int8x32), lane i: weights 4i..4i+3."""
    values = tirx.reinterpret("uint8x32", _gather_avx2(table, codes.indices(row, g, 1)))
    signed = _signed(x, row.vec(codes.signs_at + 4 * g, 4), LANES)
    return dot(values, signed, tirx.Broadcast(tirx.const(1, "int16"), 16), False)


def row_kernel(qtype: str, n_out: int, k: int, vnni: bool = True):
    """`out[0, 0, :] = x[0, 0, :] @ dequantize(w)^T`, parameters (x, w, table, out) as the
    fused `quant_matmul` it replaces (`model_defs.quant_ops`)."""
    fmt = get_format(qtype)
    codes = codes_of(qtype).grid_codes
    count = 2 if vnni else 1  # groups a step
    lanes = 8 * count  # int32 sums a step
    step = _step_vnni if vnni else _step_avx2

    def spread(ss, g):
        """Each of the step's group scales over its group's 8 lanes."""
        if count == 1:
            return tirx.Broadcast(ss[g], lanes)
        return tirx.Shuffle([ss[tirx.Ramp(g, 1, count)]] * 8, [_c(i // 8) for i in range(lanes)])

    groups = k // LANES
    per_block = fmt.block_size // LANES
    blocks = k // fmt.block_size
    rb = fmt.row_bytes(k)
    size = len(fmt.table())
    quantize = quantize_macro(groups, 1)
    streams = row_streams(n_out)
    tasks = n_out // N_CHUNK // streams
    lines = -(-rb // 64)  # a row's cache lines, asked for `AHEAD` bytes early

    @T.prim_func(s_tir=True, private=True)
    def gemv(
        x: T.Buffer((1, 1, k), "float32"),
        w: T.Buffer((n_out, rb), "uint8"),
        table: T.Buffer((size,), "uint8"),
        out: T.Buffer((1, 1, n_out), "float32"),
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        xq = T.sblock_alloc_buffer((1, k), "int8")
        xm = T.sblock_alloc_buffer((1, groups * MULT_LANES), "int16")
        xr = T.sblock_alloc_buffer((1,), "float32")
        xs = T.sblock_alloc_buffer((groups, 1), "float32")
        xmf = T.sblock_alloc_buffer((groups,), "float32")  # m per group, as float
        with T.sblock("quantize"):
            T.reads(x[0, 0, 0:k])
            T.writes(xq[0, 0:k], xm[0, :], xr[0], xs[:, 0], xmf[:])
            quantize(x, 0, xq, xm, xr, xs)
            for g in range(groups):
                xmf[g] = T.Cast("float32", xm[0, g * MULT_LANES])
        for nc in T.parallel(tasks):
            for ni, si in T.grid(N_CHUNK, streams):
                with T.sblock("dot"):
                    n = T.meta_var(streamed_row(nc, ni, si, n_out, streams))
                    T.reads(w[n, 0:rb], table[0:size], xq[0, :], xr[0], xmf[:])
                    T.writes(out[0, 0, n])
                    for j in T.unroll(lines):
                        T.evaluate(prefetch(T.address_of(w[n, j * 64 + AHEAD]), STREAM))
                    acc = T.sblock_alloc_buffer((2 * lanes,), "float32")
                    ss = T.sblock_alloc_buffer((per_block,), "float32")
                    acc[T.Ramp(0, 1, 2 * lanes)] = T.Broadcast(T.float32(0), 2 * lanes)
                    for b in range(blocks):
                        row = T.meta_var(Row(w, n, b * fmt.type_size))
                        ss[T.Ramp(0, 1, per_block)] = (
                            codes.group_scales(row) * xmf[T.Ramp(b * per_block, 1, per_block)]
                        )
                        for p in T.unroll(per_block // count):
                            x0: T.let[T.int32] = (b * per_block + count * p) * LANES
                            dots = T.meta_var(
                                step(
                                    table,
                                    codes,
                                    row,
                                    count * p,
                                    xq.vload([0, x0], f"int8x{32 * count}"),
                                )
                            )
                            acc[T.Ramp(p % 2 * lanes, 1, lanes)] = acc[
                                T.Ramp(p % 2 * lanes, 1, lanes)
                            ] + T.Cast(f"float32x{lanes}", dots) * spread(ss, count * p)
                    out[0, 0, n] = xr[0] * reduce_lanes(
                        acc[T.Ramp(0, 1, lanes)] + acc[T.Ramp(lanes, 1, lanes)], lanes, add
                    )

    return gemv
