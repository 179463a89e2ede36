"""Block formats as 32-weight groups of unsigned integer codes, for `int8_gemv`.

The integer dot-product kernel multiplies 32 weight codes by 32 int8 activations with AVX2's
`pmaddubsw` (unsigned x signed bytes). So every format is written here, per group `g` of 32
consecutive weights of one row, as

    w[g*32 + j] = scale_h * code[j] + offset_h,    h = j // 16 (the group's two halves)

with `code` a `uint8x32` vector in weight order and four float32 scalars (`scale_lo/hi`,
`offset_lo/hi`); the two halves differ only for the formats with 16-weight sub-blocks
(q2k, q3k, q6k). Signed formats are shifted to unsigned codes and the shift moves into the
offset (q4_0: `d*(q-8)` is code `q`, offset `-8d`). q8_0's codes are signed bytes and need
the full int8 range, so `signed=True` marks them for the kernel's sign trick instead.

This module holds the generic part (`Group`, `Row`, helpers); each format's group builder
lives with the format (`compiler/quant/<family>/int8_groups.py`, found through the quant
format registry's `QuantFormat.int8`), next to its TIR decoder whose scale helpers it shares,
so the two decoders cannot drift apart. The kernels built from these are checked against
`gguf.quants.dequantize` (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from tallow.compiler.quant.format import Int8Codes
from tallow.compiler.quant.registry import get_format

LANES = 32  # weights per group: one 256-bit vector of byte codes


@dataclass(frozen=True)
class Group:
    """One 32-weight group of one row, as TIR expressions."""

    codes: tirx.PrimExpr  # uint8x32 (int8x32 when signed)
    scale_lo: tirx.PrimExpr
    scale_hi: tirx.PrimExpr
    offset_lo: tirx.PrimExpr
    offset_hi: tirx.PrimExpr
    signed: bool = False


def u8(v: int, lanes: int = LANES):
    return tirx.Broadcast(tirx.const(v, "uint8"), lanes)


def splat(v, lanes: int = LANES):
    """A uint8 vector of a (possibly variable) small integer."""
    return tirx.Broadcast(tirx.Cast("uint8", v), lanes)


class Row:
    """Byte access to the blocks of row `n` of the weight buffer `w` (uint8 [N, row_bytes]);
    `table`: the format's constant table (`QuantFormat.table`, the lattice grids), a uint8
    buffer parameter of the kernel, or None."""

    def __init__(self, w: tirx.Buffer, n: tirx.PrimExpr, base: tirx.PrimExpr, table=None):
        self.w, self.n, self.base, self.table = w, n, base, table

    def byte(self, off):
        """One byte at `off` in the block, as int32 (what the TIR decoders' helpers expect)."""
        return self.w[self.n, self.base + off].astype("int32")

    def vec(self, off, lanes: int = LANES):
        return self.w.vload([self.n, self.base + off], f"uint8x{lanes}")

    def half(self, off: int):
        """The f16 at `off`, as float32.

        Read as one 32-bit load holding it (and a neighbour) and converted as a pair: a
        16-bit load became `vpinsrw` into a register that LLVM also used as an accumulator,
        a false dependency that serialised the whole loop (2x slower). The neighbour is the
        preceding f16 when there is one, so the read never passes the block's end.
        """
        first = off - 2 if off >= 2 else off
        pair = tirx.reinterpret("float16x2", self.vec(first, 4))
        return tirx.Shuffle([tirx.Cast("float32x2", pair)], [tirx.const(off - first, "int32") // 2])


def same_halves(codes, scale, offset, signed=False) -> Group:
    """A group whose two halves share one scale and one offset."""
    return Group(codes, scale, scale, offset, offset, signed)


def bits(row: Row, off, shift, mask: int):
    """32 consecutive bytes from `off`, shifted right by `shift` and masked: the K-quants'
    codes of 32 consecutive weights (their shift depends on the group's sub-block)."""
    return (row.vec(off) >> splat(shift)) & u8(mask)


def codes_of(qtype: str) -> Int8Codes:
    """What the int8 kernels know of format `qtype` (from the quant format registry)."""
    fmt = get_format(qtype)
    if fmt.int8 is None:
        raise ValueError(f"{qtype} has no int8-activation decode kernels")
    return fmt.int8


def group(w: tirx.Buffer, qtype: str, n, g, table=None) -> Group:
    """Group `g` (weights g*32 .. g*32+31) of row `n` of `w`, a `qtype` weight (`table`:
    the format's table buffer, for the formats that have one)."""
    fmt = get_format(qtype)
    block_weights, block_bytes = fmt.block_size, fmt.type_size
    per_block = block_weights // LANES
    base = g // per_block * block_bytes if per_block > 1 else g * block_bytes
    return codes_of(qtype).group(Row(w, n, base, table), g % per_block if per_block > 1 else 0)


def has_table(qtype: str) -> bool:
    """Whether `qtype` has a constant table (the lattice grids), an extra kernel parameter
    that only some kernels declare: `decode`'s AVX2 one-row kernel (`int8_gemv`, and
    `int8_grid_row`'s), `batch_decode`'s tiles on both levels (`int8_batched`) and prefill's
    (`int8_prefill`, `int8_prefill_columns`). Not the VNNI one-row kernels of the other
    formats (`int8_vnni_row`) nor the MoE kernels, which keep float activations for it."""
    return get_format(qtype).table is not None
