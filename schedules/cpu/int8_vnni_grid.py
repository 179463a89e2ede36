"""`decode`'s one-row VNNI kernel for the lattice format with 4-byte grid entries and a sign
bit per weight (iq3_s, most of an IQ3_M file).

The AVX2 row kernel (`int8_gemv._row_kernel` on `grids.int8_groups.iq3_s`) builds each
32-weight group from scalar work: 8 grid indices from a low byte and a high bit each, 8
4-byte table loads joined into a vector, the signs applied to the values, then q8_0's sign
trick takes them off again for `pmaddubsw`. Here two groups go through one `vpdpbusd`:

* the 16 indices are computed as one vector (`GridPairs.indices`) and their entries fetched
  by one `vpgatherdd` (64 bytes: the two groups' grid values, 1..15, unsigned as they are);
* the sign bits go onto the activations instead of the weights: the 8 sign bytes spread to
  one byte per weight, tested against each byte's bit, and the activations negated where it
  is set (|activation| <= 127, so the negation is exact). No offset, no flip;
* the block's 8 group scales are decoded as one vector (`GridPairs.group_scales`) times
  `xmf`, each pair's two spread over the 16 lanes;
* a row's cache lines are asked for 16 KiB ahead into L2 and each task follows two streams,
  as `int8_vnni_row` does (without them one thread read 4.7 GB/s of iq3_s weights).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from ..tir_common import STREAM, add, prefetch, reduce_lanes
from .int8_codes import LANES, Row, codes_of
from .int8_ops import MULT_LANES, N_CHUNK, quantize_macro
from .int8_vnni import COLS, _vpdpbusd
from .int8_vnni_row import AHEAD, STREAMS

PAIR = 2 * LANES
# byte i of a spread sign vector is tested against bit i % 8
_BIT_OF_LANE = int.from_bytes(bytes(1 << i for i in range(8)), "little", signed=True)


def _c(i: int):
    return tirx.const(i, "int32")


def applies(qtype: str, k: int) -> bool:
    """Whether `qtype` has a VNNI grid kernel and rows of `k` split into its blocks."""
    fmt = get_format(qtype)
    return codes_of(qtype).grid_pairs is not None and k % fmt.block_size == 0


def _gather(table, indices):
    """int32x16: the 4-byte grid entries at `indices` of the uint8 `table` (`vpgatherdd`)."""
    return T.call_llvm_intrin(
        "int32x16",
        "llvm.x86.avx512.gather.dpi.512",
        tirx.Broadcast(_c(0), COLS),
        T.address_of(table[0]),
        indices,
        tirx.const(-1, "int16"),
        _c(4),
    )


def _signed(x, sign_bytes):
    """int8x64 activations `x` negated where the weight's sign bit is set (bit j of the 8
    `sign_bytes`, byte j // 8)."""
    spread = tirx.Shuffle([sign_bytes] * 8, [_c(i // 8) for i in range(PAIR)])  # (no widening)
    bit = tirx.reinterpret("uint8x64", tirx.Broadcast(tirx.const(_BIT_OF_LANE, "int64"), 8))
    negative = tirx.NE(spread & bit, tirx.Broadcast(tirx.const(0, "uint8"), PAIR))
    return tirx.Select(negative, tirx.Broadcast(tirx.const(0, "int8"), PAIR) - x, x)


def row_kernel(qtype: str, n_out: int, k: int):
    """`out[0, 0, :] = x[0, 0, :] @ dequantize(w)^T`, parameters (x, w, table, out) as the
    fused `quant_matmul` it replaces (`model_defs.quant_ops`)."""
    fmt = get_format(qtype)
    pairs_of = codes_of(qtype).grid_pairs
    groups = k // LANES
    per_block = fmt.block_size // LANES
    blocks = k // fmt.block_size
    rb = fmt.row_bytes(k)
    size = len(fmt.table())
    quantize = quantize_macro(groups, 1)
    streams = STREAMS if (n_out // N_CHUNK) % STREAMS == 0 else 1
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
                    n = T.meta_var((si * tasks + nc) * N_CHUNK + ni)
                    T.reads(w[n, 0:rb], table[0:size], xq[0, :], xr[0], xmf[:])
                    T.writes(out[0, 0, n])
                    for j in T.unroll(lines):
                        T.evaluate(prefetch(T.address_of(w[n, j * 64 + AHEAD]), STREAM))
                    acc = T.sblock_alloc_buffer((2 * COLS,), "float32")
                    ss = T.sblock_alloc_buffer((per_block,), "float32")
                    acc[T.Ramp(0, 1, 2 * COLS)] = T.Broadcast(T.float32(0), 2 * COLS)
                    for b in range(blocks):
                        row = T.meta_var(Row(w, n, b * fmt.type_size))
                        ss[T.Ramp(0, 1, per_block)] = (
                            pairs_of.group_scales(row) * xmf[T.Ramp(b * per_block, 1, per_block)]
                        )
                        for p in T.unroll(per_block // 2):
                            x0: T.let[T.int32] = (b * per_block + 2 * p) * LANES
                            dots: T.let[T.int32x16] = _vpdpbusd(
                                T.Broadcast(T.int32(0), COLS),
                                tirx.reinterpret(
                                    "uint8x64", _gather(table, pairs_of.indices(row, p))
                                ),
                                _signed(
                                    xq.vload([0, x0], "int8x64"),
                                    row.vec(pairs_of.signs_at + 8 * p, 8),
                                ),
                            )
                            acc[T.Ramp(p % 2 * COLS, 1, COLS)] = acc[
                                T.Ramp(p % 2 * COLS, 1, COLS)
                            ] + T.Cast("float32x16", dots) * T.Shuffle(
                                [ss[T.Ramp(2 * p, 1, 2)]] * 8, [i // 8 for i in range(COLS)]
                            )
                    out[0, 0, n] = xr[0] * reduce_lanes(
                        acc[T.Ramp(0, 1, COLS)] + acc[T.Ramp(COLS, 1, COLS)], COLS, add
                    )

    return gemv
