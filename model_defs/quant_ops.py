"""Dequantizing TE expressions and nn modules for llama.cpp's GGUF block formats.

Physical layout: the weight is exactly the GGUF tensor data, ``uint8[rows, row_bytes]`` with
``row_bytes = cols / block_size * type_size``; no repacking, so the weight converter can copy
the bytes straight from a .gguf file (or from ``tallow.compiler.quant.quantize``). Per block
(offsets in bytes, little-endian, as llama.cpp's ``block_*`` structs):

========  ====  ===========================================================================
type      size  layout
========  ====  ===========================================================================
q8_0      34    d:f16 @0, qs:int8[32] @2                       w = d*q
q4_0      18    d @0, qs[16] @2 (lo nibble w[i], hi w[i+16])   w = d*(q-8)
q4_1      20    d @0, m @2, qs[16] @4                          w = d*q + m
q5_0      22    d @0, qh:u32 @2 (bit i = bit 4 of w[i]), qs @6 w = d*(q-16)
q5_1      24    d @0, m @2, qh @4, qs @8                       w = d*q + m
q2k       84    scales[16] @0 (lo: scale, hi: min), qs[64] @16, d @80, dmin @82
q3k       110   hmask[32] @0, qs[64] @32, scales (16 x 6 bit)[12] @96, d @108
q4k       144   d @0, dmin @2, scales (8+8 x 6 bit)[12] @4, qs[128] @16
q5k       176   d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48
q6k       210   ql[128] @0, qh[64] @128, scales:int8[16] @192, d @208
========  ====  ===========================================================================

Every decoder below reads bytes through a ``byte(offset_in_block)`` callback, so the same
expression serves the full-matrix dequantization, the fused matmul and the embedding lookup
(which reads the blocks of looked-up rows only).

Bit-exactness with ``gguf.quants.dequantize``: an f16 scale has 11 significant bits and the
integer codes/sub-scales at most 6 bits each, so every product here is exact in float32; only
the final add of the offset rounds. Hence the result does not depend on the order of the
multiplications nor on whether LLVM contracts the multiply-add into an FMA.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

# name -> (weights per block, bytes per block); must agree with tallow.compiler.quant.
BLOCK = {
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q2k": (256, 84),
    "q3k": (256, 110),
    "q4k": (256, 144),
    "q5k": (256, 176),
    "q6k": (256, 210),
}

Byte = Callable  # offset in block -> int32 value 0..255


def row_bytes(qtype: str, cols: int) -> int:
    bs, ts = BLOCK[qtype]
    if cols % bs:
        raise ValueError(f"{qtype}: row length {cols} is not a multiple of the block size {bs}")
    return cols // bs * ts


def _f32(v):
    return v.astype("float32")


def _half(byte: Byte, off: int):
    """IEEE half at `off` -> float32 (reinterpret the u16 bits, widen exactly)."""
    bits = (byte(off) | (byte(off + 1) << 8)).astype("uint16")
    return tirx.reinterpret("float16", bits).astype("float32")


def _signed(b):
    """A byte 0..255 read as int8, in int32."""
    return b - ((b >> 7) << 8)


def _bit(b, shift):
    return (b >> shift) & 1


# Each decoder: (byte, j) -> float32 value of weight j (0 <= j < block size) of the block.


def _q8_0(byte, j):
    return _half(byte, 0) * _f32(_signed(byte(2 + j)))


def _nibble(byte, base, j):
    """Legacy 32-weight nibble packing: byte i holds weight i (low) and weight i + 16 (high)."""
    return (byte(base + j % 16) >> (j // 16 * 4)) & 15


def _q4_0(byte, j):
    return _half(byte, 0) * _f32(_nibble(byte, 2, j) - 8)


def _q4_1(byte, j):
    return _half(byte, 0) * _f32(_nibble(byte, 4, j)) + _half(byte, 2)


def _u32(byte, off):
    """The little-endian 32-bit word at `off` (as int32: bit 31 lands in the sign)."""
    return byte(off) | (byte(off + 1) << 8) | (byte(off + 2) << 16) | (byte(off + 3) << 24)


# The fifth bits are read as one word shifted by j, not as byte j // 8 shifted by j % 8: the
# same word for every lane keeps a vectorised decode a vector shift (per-byte indexing made
# TVM fall back to scalar code, 5x slower).


def _q5_0(byte, j):
    q = _nibble(byte, 6, j) | (_bit(_u32(byte, 2), j) << 4)
    return _half(byte, 0) * _f32(q - 16)


def _q5_1(byte, j):
    q = _nibble(byte, 8, j) | (_bit(_u32(byte, 4), j) << 4)
    return _half(byte, 0) * _f32(q) + _half(byte, 2)


def _q2k(byte, j):
    # 2-bit codes: byte 16 + 32*(j//128) + j%32, bit pair (j%128)//32; scale/min per 16.
    sc = byte(j // 16)
    q = (byte(16 + j // 128 * 32 + j % 32) >> (j % 128 // 32 * 2)) & 3
    dl = _half(byte, 80) * _f32(sc & 15)
    return dl * _f32(q) - _half(byte, 82) * _f32(sc >> 4)


def _q3k(byte, j):
    s = j // 16
    lo = (byte(96 + s % 8) >> (s // 8 * 4)) & 15
    hi = (byte(104 + s % 4) >> (s // 4 * 2)) & 3
    scale = (lo | (hi << 4)) - 32
    ql = (byte(32 + j // 128 * 32 + j % 32) >> (j % 128 // 32 * 2)) & 3
    # a clear hmask bit subtracts 4 (llama.cpp's "offset is zero when the bit is set")
    hbit = _bit(byte(j % 32), j // 128 * 4 + j % 128 // 32)
    q = ql - ((1 - hbit) << 2)
    return _half(byte, 108) * _f32(scale) * _f32(q)


def _k4_scale_min(byte, sb):
    """llama.cpp's get_scale_min_k4 for sub-block sb (0..7), scales at bytes 4..15.

    Sub-blocks 0-3 keep 6 bits in one byte; 4-7 take 4 low bits from bytes 12..15 and 2 high
    bits from the top of bytes 4..11. Written without a select, as offsets and shifts that
    depend on `lo` (1 for sub-blocks 0-3): a select on the sub-block stayed a per-lane
    blend in the vectorised decode (3x the work of q4_1 per weight).
    """
    lo = 1 - sb // 4
    high_shift = 6 - 2 * lo  # the 2 high bits: bits 4-5 of one byte, or 6-7 of another
    sc = (byte(8 + sb - 4 * lo) & 15) | (((byte(sb + 4 * lo) >> high_shift) & 3) << 4)
    mn = ((byte(8 + sb) >> (4 - 4 * lo)) & 15) | (((byte(4 + sb + 4 * lo) >> high_shift) & 3) << 4)
    return sc, mn


def _k4_codes(byte, base, j):
    """K-quant 4-bit codes: 64-weight chunks of 32 bytes, low nibbles first then high."""
    return (byte(base + j // 64 * 32 + j % 32) >> (j % 64 // 32 * 4)) & 15


def _q4k(byte, j):
    sc, mn = _k4_scale_min(byte, j // 32)
    q = _k4_codes(byte, 16, j)
    return _half(byte, 0) * _f32(sc) * _f32(q) - _half(byte, 2) * _f32(mn)


def _q5k(byte, j):
    sc, mn = _k4_scale_min(byte, j // 32)
    q = _k4_codes(byte, 48, j) | (_bit(byte(16 + j % 32), j // 32) << 4)
    return _half(byte, 0) * _f32(sc) * _f32(q) - _half(byte, 2) * _f32(mn)


def _q6k(byte, j):
    n, g, lane = j // 128, j % 128 // 32, j % 32
    ql = (byte(n * 64 + g % 2 * 32 + lane) >> (g // 2 * 4)) & 15
    qh = (byte(128 + n * 32 + lane) >> (g * 2)) & 3
    q = (ql | (qh << 4)) - 32
    return _half(byte, 208) * _f32(_signed(byte(192 + j // 16))) * _f32(q)


DECODERS = {
    "q8_0": _q8_0,
    "q4_0": _q4_0,
    "q4_1": _q4_1,
    "q5_0": _q5_0,
    "q5_1": _q5_1,
    "q2k": _q2k,
    "q3k": _q3k,
    "q4k": _q4k,
    "q5k": _q5k,
    "q6k": _q6k,
}


def dequant_value(read: Callable, qtype: str, col, out_dtype: str = "float32"):
    """Weight `col` of a row whose bytes are `read(byte_index_in_row)` (uint8 expressions)."""
    bs, ts = BLOCK[qtype]
    base = col // bs * ts

    def byte(off):
        return read(base + off).astype("int32")

    # int32 lane arithmetic: with int64 (the index type nn uses) the vectorised shifts and
    # masks would run on half-width vectors.
    j = col % bs
    value = DECODERS[qtype](byte, j.astype("int32") if hasattr(j, "astype") else j)
    return value if out_dtype == "float32" else value.astype(out_dtype)


def dequantize_te(
    blocks: te.Tensor, qtype: str, rows: int, cols: int, out_dtype: str = "float32"
) -> te.Tensor:
    """uint8 [rows, row_bytes] GGUF blocks -> out_dtype [rows, cols], a block "dequantize"."""
    if qtype not in BLOCK:
        raise ValueError(f"unknown quantization type {qtype!r}; valid: {', '.join(BLOCK)}")
    row_bytes(qtype, cols)  # validates cols
    return te.compute(
        (rows, cols),
        lambda r, c: dequant_value(lambda b: blocks[r, b], qtype, c, out_dtype),
        name="dequantize",
    )


def quant_matmul_te(x: te.Tensor, w: te.Tensor, qtype: str, n: int, out_dtype: str):
    """x [..., K] @ dequantize(w)^T -> [..., n]: one PrimFunc holding dequantize + matmul."""
    k_dim = int(x.shape[-1])
    deq = dequantize_te(w, qtype, n, k_dim, out_dtype)
    k = te.reduce_axis((0, k_dim), name="k")
    return te.compute(
        (*x.shape[:-1], n),
        lambda *i: te.sum(x[(*i[:-1], k)] * deq[i[-1], k], axis=k),
        name="matmul",
    )


# PrimFunc attribute naming a fused dequantize-matmul's weight format, so that later passes
# (the CPU's int8-activation decode kernels) can find these kernels without parsing names.
QUANT_TYPE_ATTR = "tallow.quant_type"


def quant_matmul(x: Tensor, w: Tensor, qtype: str, n: int, out_dtype: str) -> Tensor:
    """`x @ dequantize(w)^T` as one `tensor_expr_op`, tagged with its format."""
    return op.tensor_expr_op(
        lambda xt, wt: quant_matmul_te(xt, wt, qtype, n, out_dtype),
        name_hint=f"quant_matmul_{qtype}",
        args=[x, w],
        attrs={QUANT_TYPE_ATTR: qtype},
    )


class QuantLinear(nn.Module):
    """`y = x @ W^T` with W stored as GGUF blocks (parameter `weight`, uint8 [out, row_bytes]).

    The dequantization and the matmul are one `tensor_expr_op`, so they are born as one
    PrimFunc: no fusion pass is needed and W is never materialised in full precision once
    `tallow.schedules.cpu_quant` (or dlight, which recognises the "dequantize" block) has put
    the dequantize block inside the reduction loop.
    """

    def __init__(self, in_features: int, out_features: int, qtype: str, out_dtype="float32"):
        self.in_features = in_features
        self.out_features = out_features
        self.qtype = qtype
        self.out_dtype = out_dtype
        self.weight = nn.Parameter((out_features, row_bytes(qtype, in_features)), dtype="uint8")

    def forward(self, x: Tensor) -> Tensor:
        return quant_matmul(x, self.weight, self.qtype, self.out_features, self.out_dtype)


class QuantEmbedding(nn.Module):
    """Embedding table as GGUF blocks; dequantizes only the looked-up rows (take, then decode)."""

    def __init__(self, num: int, dim: int, qtype: str, out_dtype: str = "float32"):
        self.num = num
        self.dim = dim
        self.qtype = qtype
        self.out_dtype = out_dtype
        self.weight = nn.Parameter((num, row_bytes(qtype, dim)), dtype="uint8")

    def forward(self, ids: Tensor) -> Tensor:
        qtype, dim, dt = self.qtype, self.dim, self.out_dtype

        def compute(idt: te.Tensor, wt: te.Tensor) -> te.Tensor:
            return te.compute(
                (*idt.shape, dim),
                lambda *i: dequant_value(lambda b: wt[idt[i[:-1]], b], qtype, i[-1], dt),
                name="dequantize",
            )

        return op.tensor_expr_op(
            compute, name_hint=f"quant_embedding_{qtype}", args=[ids, self.weight]
        )
