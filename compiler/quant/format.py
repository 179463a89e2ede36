"""`QuantFormat`: everything tallow knows about one weight block format, in one record.

A format is registered once (`registry.register_format`, done by its family package:
`legacy`, `kquants`, `iquants`) and every layer reads it from there: the numpy quantizer
and decoder (`tallow.compiler.quant.quantize`), the `--quant` plan and its fallback, the
GGUF reader's type table, the TE dequantize-matmul of `model_defs.quant_ops`, and the CPU
int8-activation decode kernels of `schedules.cpu.int8_*`.

The TIR pieces need TVM and the int8 group builders import `schedules`, which imports the
registry: a family therefore names them with `Lazy(module, name)`, resolved on first call,
so that numpy-only users never import TVM and the import graph has no cycle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (byte, j) -> float32 TIR value of weight j of a block, `byte(offset)` reading the block's
# bytes as int32 expressions (see `model_defs.quant_ops.dequant_value`).
TirDecoder = Callable[[Callable[[Any], Any], Any], Any]


@dataclass(frozen=True)
class Lazy:
    """The function `name` of `module`, imported when first called."""

    module: str
    name: str

    def resolve(self) -> Callable:
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)


@dataclass(frozen=True)
class LeadingScale:
    """Every 32 weights start with an f16 scale `d` (the legacy formats, iq4_nl). Column
    tiles then load 8 or 16 rows' scales as one vector instead of decoding each row's group.
    The offset is the f16 min stored right after `d` when `code_shift` is None, else
    `d * code_shift` (the shift that makes the codes unsigned: q4_0 -8, q8_0 and iq4_nl
    -128, the VNNI tiles' flip of their signed codes)."""

    code_shift: float | None = None


@dataclass(frozen=True)
class TableNibbles:
    """A super-block format whose codes are 4-bit indices into a 16-value int8 table (iq4_xs):
    16 bytes per 32-weight group from `codes_at`, byte t holding weight t (low nibble) and
    t + 16 (high). `group_scales(*rows)` gives each group's scale (table units to weights)
    as a float32 vector, one lane per group, the blocks of `rows` one after another. The
    VNNI row kernel (`schedules.cpu.int8_table_row`) reads a block with 64-byte loads."""

    table: Any  # the 16 int8 values, a numpy array
    codes_at: int
    group_scales: Callable


@dataclass(frozen=True)
class IntBlockScales:
    """A super-block format whose group scales are small integers under one float scale (q4k,
    q5k: 6-bit sub-scales times the f16 `d`). `decode(row)` gives (the 8 sub-scales as
    int16x8, `d` as a float32, the groups' offsets as float32x8); `largest` bounds the
    sub-scales. The AVX2 one-row kernel (`schedules.cpu.int8_kquant_row`) then multiplies
    each group's integer sums by sub-scale times activation multiplier in int16 and converts
    once per super-block."""

    decode: Callable
    largest: int


@dataclass(frozen=True)
class GridCodes:
    """A lattice format whose 32-weight groups are 8 entries of 4 unsigned grid bytes plus a
    sign bit per weight (iq3_s), as the row kernels of `schedules.cpu.int8_grid_row` read it:
    `indices(row, g, count)` the grid indices (int32 x 8 count) of groups g .. g + count - 1
    of a block, their sign bytes at `signs_at + 4 g` (bit j: weight j), and
    `group_scales(row)` the block's group scales as a float32 vector."""

    indices: Callable
    signs_at: int
    group_scales: Callable


@dataclass(frozen=True)
class Int8Codes:
    """How the CPU int8-activation decode kernels (`schedules.cpu.int8_*`) read a format.

    `group(row, sub)` returns a `schedules.cpu.int8_codes.Group`: 32 consecutive weights as
    unsigned byte codes plus a scale and an offset per 16-weight half (`sub` is the group's
    index inside a block larger than 32 weights, else 0). The block size must be a multiple
    of 32. The other fields are what the kernels specialise on.
    """

    group: Callable
    signed: bool = False  # codes are int8 (q8_0, the i-quants): the kernels use a sign trick
    split_halves: bool = False  # the two 16-weight halves have their own scale and offset
    max_code: int | None = None  # largest unsigned code; column tiles need it (int16 sums)
    # `batch_decode` takes the AVX2 column tiles at every batch size, else the row tiles
    # (measured per format, see `schedules.cpu.int8_columns`; one tile family per format at
    # every size keeps a row's bits independent of the batch). They need `max_code`.
    column_tiles: bool = False
    nibble_codes_at: int | None = None  # legacy 4-bit codes' offset: transposed as bytes
    # q5_0 / q5_1: where the 32-bit word of the codes' fifth bits sits (bit j: weight j);
    # with `nibble_codes_at`, the VNNI tiles transpose the nibbles as bytes and add these
    fifth_bits_at: int | None = None
    leading_scale: LeadingScale | None = None
    # `block_scales(*rows) -> (scales, offsets)`: all of a super-block's group scales and
    # offsets as two float32 vectors (one lane per group, or per half with `split_halves`),
    # decoded with vector instructions once per block instead of once per group; several
    # blocks (`Row`s) give their lanes one block after another
    block_scales: Callable | None = None
    # where a super-block's codes sit as 32-byte runs whose low nibbles are one group's and
    # high nibbles the next group's (q4k): the VNNI tiles transpose the bytes once per pair
    nibble_pairs_at: int | None = None
    # q6k: where a super-block's low-nibble bytes and its high-bit bytes start (per 128
    # weights, 64 bytes of nibbles: groups j and j + 2 in bytes 32j.., and 32 bytes of top
    # bits: bits 2j, 2j + 1 for group j); the VNNI tiles transpose 3 runs per 4 groups
    six_bit_at: tuple[int, int] | None = None
    table_nibbles: TableNibbles | None = None
    int_block_scales: IntBlockScales | None = None
    grid_codes: GridCodes | None = None


@dataclass(frozen=True)
class QuantFormat:
    """One block format: `block_size` weights stored in `type_size` bytes.

    Data is `uint8[rows, row_bytes]`, the blocks of a row back to back, byte for byte as
    GGUF stores them when `ggml_type` is set (None: a format of our own).
    """

    name: str  # the `--quant` name and the manifest's ("q4_0", "q4k")
    ggml_type: Any  # gguf.GGMLQuantizationType, or None
    block_size: int
    type_size: int
    # [n_blocks, block_size] float32 -> [n_blocks, type_size] uint8, and back; None: tallow
    # reads the format but does not write it (`no_quantizer` says why)
    quantize_blocks: Callable | None
    dequantize_blocks: Callable
    # with `table`, the decoder takes a third argument: `table(i)`, byte i of the table
    tir_decode: TirDecoder
    # the format a `--quant` weight takes when its row length is not a multiple of
    # `block_size` (llama.cpp's choice; its block size a proper divisor of ours); None: the
    # weight stays float
    fallback: str | None = None
    int8: Int8Codes | None = None  # None: no int8-activation decode kernels
    # `table() -> uint8 ndarray`: constant data the TIR decoder reads (the lattice i-quants'
    # grids), handed to the fused kernels as a constant parameter (`model_defs.quant_ops`);
    # the GPU schedules and the MoE kernels do not take such formats
    table: Callable | None = None
    no_quantizer: str | None = None  # why `quantize_blocks` is None
    # False: the GPU schedules do not take this format (checked on OpenCL/PoCL, see the
    # family's docstring); a compile for a GPU target refuses it at once
    gpu: bool = True

    @property
    def bits_per_weight(self) -> float:
        return self.type_size * 8 / self.block_size

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` weights."""
        if cols % self.block_size:
            raise ValueError(
                f"{self.name}: row length {cols} is not a multiple of the block size "
                f"{self.block_size}"
            )
        return cols // self.block_size * self.type_size

    def fits(self, cols: int) -> bool:
        """Whether rows of `cols` weights split into whole blocks."""
        return cols % self.block_size == 0
