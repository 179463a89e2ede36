"""`decode`'s one-row kernels for the 4-bit table formats with super-blocks (iq4_xs), on
AVX-512 VNNI and on AVX2, built on `int8_vnni_row`'s scaffold (activations quantized and
reordered once per call, rows prefetched, two streams per task).

Through the generic kernels (`int8_vnni_row._pair_dot_macro`, `int8_gemv._row_kernel`) an
iq4_xs group cost a 16-byte load, two nibble masks, a 256-bit `vpshufb`, a join, the scale's
scalar decode (two byte loads, shifts, an f16 convert) and a scalar offset FMA: on an Intel
Xeon with AVX-512 VNNI one thread read 4.4-4.6 GB/s of iq4_xs weights from memory where
q4k's kernel reads 10-11.4 (`benchmarks/gemv_bandwidth.py`), and Llama-3.2-3B IQ4_XS spent
163 of its 188 ms decode step in these projections.

Here a super-block's 128 code bytes are read in 64-byte loads (VNNI; 32 on AVX2), each
holding 4 (2) groups' nibbles (`TableNibbles.codes_at`: 16 bytes per group, byte t holding
weight t in its low nibble and t + 16 in its high one). The low nibbles of a load are its
groups' first 16 weights, the high nibbles their last 16; the activations are copied once
per call into that order (`source_chunk`). The block's 8 group scales
(`TableNibbles.group_scales`; two blocks as one 16-lane vector on VNNI) are decoded with
vector instructions once per block, times `xmf` (each group's activation multiplier).

* VNNI: one 512-bit `vpshufb` per 64 weights turns the nibbles into table values plus 128
  (1..241: `vpdpbusd`'s unsigned operand, so no sign flip), two `vpdpbusd` into one int32
  chain give, per 4 lanes, one group's dot product; the `+128` offsets meet the activation
  sums in one vector FMA per two blocks.
* AVX2: one 256-bit `vpshufb` per 32 weights gives the signed table values, q8_0's sign
  trick (`int8_ops.dot`, `pmaddubsw` with `pmaddwd` by ones: `m` is in the float scale)
  multiplies them; no offsets.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from ..tir_common import STREAM, add, prefetch, reduce_lanes
from .int8_codes import LANES, Row, codes_of
from .int8_ops import dot
from .int8_vnni import COLS, _vpdpbusd

LOAD = 64  # code bytes per load on VNNI: 4 groups (AVX2: `AVX2_LOAD`, 2 groups)
AVX2_LOAD = 32
CHUNK = 16  # activation bytes that stay together when reordered (half a group)
GROUPS_PER_LOAD = LOAD // CHUNK


def _c(i: int):
    return tirx.const(i, "int32")


def applies(qtype: str) -> bool:
    """Whether `qtype`'s codes are table nibbles in blocks of whole 64-byte loads."""
    nibbles = codes_of(qtype).table_nibbles
    return nibbles is not None and get_format(qtype).block_size % (2 * LOAD) == 0


def source_chunk(c, load: int = LOAD):
    """The 16-byte activation chunk (of `xq`) that goes to chunk `c` of the kernel's order:
    per load of `load` code bytes (`load // 16` groups), the groups' first halves, then their
    second halves."""
    per_load = load // CHUNK
    i, h, j = c // (2 * per_load), c % (2 * per_load) // per_load, c % per_load
    return (i * per_load + j) * 2 + h


def _lookup(table, indices):
    """uint8x64: `table`'s byte (of 16 python ints, 0..255) at each of `indices` (0..15), by
    one 512-bit `vpshufb` (AVX-512 BW: every CPU with AVX-512 VNNI has it), whose table is
    the 16 bytes in each 128-bit lane, built from two int64 constants."""
    raw = bytes(v & 0xFF for v in table)
    lo, hi = (int.from_bytes(raw[i : i + 8], "little", signed=True) for i in (0, 8))
    words = tirx.Shuffle(
        [tirx.Broadcast(tirx.const(v, "int64"), 4) for v in (lo, hi)],
        [_c(i) for i in (0, 4, 1, 5, 2, 6, 3, 7)],
    )
    looked = T.call_llvm_pure_intrin(
        "int8x64",
        "llvm.x86.avx512.pshuf.b.512",
        tirx.reinterpret("int8x64", words),
        tirx.reinterpret("int8x64", indices),
    )
    return tirx.reinterpret("uint8x64", looked)


def _spread4(scales):
    """float32x16: lane i gets scale i // 4 (of 4): the lanes of one load's 4 groups."""
    return tirx.Shuffle([scales] * 4, [_c(i // 4) for i in range(COLS)])


def dot_macro(qtype: str, groups: int, ahead: int):
    """A macro: row `n`'s result into `out[0, 0, n]` (arguments as `int8_vnni_row`'s, the
    activations in `source_chunk`'s order)."""
    fmt = get_format(qtype)
    nibbles = codes_of(qtype).table_nibbles
    per_block = fmt.block_size // LANES
    loads = fmt.block_size // (2 * LOAD)  # per block
    blocks = groups // per_block
    step = 2 if blocks % 2 == 0 else 1  # blocks whose scales decode as one vector
    sw = per_block * step
    lines = -(-step * fmt.type_size // LOAD) if ahead else 0
    table = [int(v) + 128 for v in nibbles.table]  # unsigned codes for vpdpbusd
    mask = tirx.Broadcast(tirx.const(15, "uint8"), LOAD)
    four = tirx.Broadcast(tirx.const(4, "uint8"), LOAD)

    def row_scales(w, n, b):
        return nibbles.group_scales(
            *[Row(w, n, (b * step + i) * fmt.type_size) for i in range(step)]
        )

    @T.macro
    def dot_row(w, n, xq, xr, sums, xmf, out):
        acc = T.sblock_alloc_buffer((2 * COLS,), "float32")
        off = T.sblock_alloc_buffer((sw,), "float32")
        ss = T.sblock_alloc_buffer((sw,), "float32")
        acc[T.Ramp(0, 1, 2 * COLS)] = T.Broadcast(T.float32(0), 2 * COLS)
        off[T.Ramp(0, 1, sw)] = T.Broadcast(T.float32(0), sw)
        for b in range(blocks // step):
            for j in T.unroll(lines):
                T.evaluate(
                    prefetch(T.address_of(w[n, b * step * fmt.type_size + j * 64 + ahead]), STREAM)
                )
            scales = T.meta_var(row_scales(w, n, b))
            ss[T.Ramp(0, 1, sw)] = scales * xmf[T.Ramp(b * sw, 1, sw)]
            off[T.Ramp(0, 1, sw)] = off[T.Ramp(0, 1, sw)] + scales * sums[T.Ramp(b * sw, 1, sw)]
            for u in T.unroll(step * loads):
                v: T.let[T.uint8x64] = w.vload(
                    [
                        n,
                        (b * step + u // loads) * fmt.type_size
                        + nibbles.codes_at
                        + u % loads * LOAD,
                    ],
                    "uint8x64",
                )
                x0: T.let[T.int32] = (b * step * per_block + u * GROUPS_PER_LOAD) * LANES
                dots: T.let[T.int32x16] = _vpdpbusd(
                    _vpdpbusd(
                        T.Broadcast(T.int32(0), COLS),
                        _lookup(table, v & mask),
                        xq.vload([0, x0], "int8x64"),
                    ),
                    _lookup(table, (v >> four) & mask),
                    xq.vload([0, x0 + LOAD], "int8x64"),
                )
                acc[T.Ramp(u % 2 * COLS, 1, COLS)] = acc[T.Ramp(u % 2 * COLS, 1, COLS)] + T.Cast(
                    "float32x16", dots
                ) * _spread4(ss[T.Ramp(u * GROUPS_PER_LOAD, 1, GROUPS_PER_LOAD)])
        # codes are table values + 128: their dot product carries 128 * the activations' sum
        out[0, 0, n] = xr[0] * reduce_lanes(
            acc[T.Ramp(0, 1, COLS)] + acc[T.Ramp(COLS, 1, COLS)], COLS, add
        ) - T.float32(128) * reduce_lanes(off[T.Ramp(0, 1, sw)], sw, add)

    return dot_row


def avx2_dot_macro(qtype: str, groups: int, ahead: int):
    """`dot_macro` on AVX2 (the module doc): the activations in `source_chunk(c, AVX2_LOAD)`'s
    order."""
    from tallow.compiler.quant.iquants.int8_groups import table_codes  # (imports schedules)

    fmt = get_format(qtype)
    nibbles = codes_of(qtype).table_nibbles
    per_block = fmt.block_size // LANES
    loads = fmt.block_size // (2 * AVX2_LOAD)  # per block
    blocks = groups // per_block
    lines = -(-fmt.type_size // 64) if ahead else 0
    per_load = AVX2_LOAD // CHUNK  # groups
    mask = tirx.Broadcast(tirx.const(15, "uint8"), AVX2_LOAD)
    four = tirx.Broadcast(tirx.const(4, "uint8"), AVX2_LOAD)
    ones = tirx.Broadcast(tirx.const(1, "int16"), 16)

    def values(v):
        return table_codes(v, nibbles.table)

    @T.macro
    def dot_row(w, n, xq, xr, sums, xmf, out):
        acc = T.sblock_alloc_buffer((16,), "float32")
        ss = T.sblock_alloc_buffer((per_block,), "float32")
        acc[T.Ramp(0, 1, 16)] = T.Broadcast(T.float32(0), 16)
        for b in range(blocks):
            for j in T.unroll(lines):
                T.evaluate(prefetch(T.address_of(w[n, b * fmt.type_size + j * 64 + ahead]), STREAM))
            ss[T.Ramp(0, 1, per_block)] = (
                nibbles.group_scales(Row(w, n, b * fmt.type_size))
                * xmf[T.Ramp(b * per_block, 1, per_block)]
            )
            for u in T.unroll(loads):
                v: T.let[T.uint8x32] = w.vload(
                    [n, b * fmt.type_size + nibbles.codes_at + u * AVX2_LOAD], "uint8x32"
                )
                x0: T.let[T.int32] = (b * per_block + u * per_load) * LANES
                dots: T.let[T.int32x8] = dot(
                    values(v & mask), xq.vload([0, x0], "int8x32"), ones, True
                ) + dot(values((v >> four) & mask), xq.vload([0, x0 + 32], "int8x32"), ones, True)
                acc[T.Ramp(u % 2 * 8, 1, 8)] = acc[T.Ramp(u % 2 * 8, 1, 8)] + T.Cast(
                    "float32x8", dots
                ) * T.Shuffle(
                    [ss[T.Ramp(u * per_load, 1, per_load)]] * 4, [i // 4 for i in range(8)]
                )
        out[0, 0, n] = xr[0] * reduce_lanes(acc[T.Ramp(0, 1, 8)] + acc[T.Ramp(8, 1, 8)], 8, add)

    return dot_row
