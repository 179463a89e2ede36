"""Prefill matmuls on AMX tiles (Sapphire Rapids and newer Xeons): bf16 products.

AVX-512 VNNI's prefill tiles (`int8_prefill`) do 64 multiply-adds per `vpdpbusd` and then,
per token row, group of 32 weights and 16 columns, convert and scale the group's integer
sums: about 13 vector instructions per 512 multiply-adds. An AMX `tdpbf16ps` multiplies 16
rows of 32 bf16 activations by a 32 x 16 block of bf16 weights into 16 x 16 float sums, 8,192
multiply-adds, accumulating over the whole K in the tile register. So here:

* a task (32 output columns, a tile of 128 token rows) first decodes its columns' weights,
  group by group, with the VNNI tiles' own decoders (`int8_vnni.tile_macro`'s group hook:
  the transposed codes of 16 columns and each group's scales and offsets), to bf16 in
  AMX's B layout (pairs of a column's weights in a 32-bit word; 1 KiB a group and 16
  columns, a panel of K KiB for the task's 32);
* then runs the tile's rows 32 at a time: four float tiles (2 x 16 rows by 2 x 16 columns)
  accumulate every group's products, over the whole K; each A tile (16 rows of a group's
  32 activations) serves both column tiles, each B tile both row tiles. The A tiles come
  from a bf16 copy of the activations laid out by tile, group, row, as `int8_prefill` lays
  its codes, so a tile's rows of a group are 1 KiB in a row;
* the activations and the weights are rounded to bf16 (to nearest even), the sums float.

One B tile a task and four row tiles a pass (16 columns) ran q4k 3072 -> 8192, 500 rows,
one thread, at 48.8 ms; two B tiles (each A tile loaded once for 32 columns) at 40.1 ms,
against the VNNI tiles' 91-102 ms (Intel Xeon, AMX; best of 5). Tiles of 256 or 512 rows
were slower (76 and 70 ms): the activations of a tile leave L2.

Numerics: not the int8 rounding of the VNNI tiles and of decode. A weight keeps 8 bits of
mantissa after its 4-6 bit code was scaled (a relative error under 2^-9, far below the
format's own), an activation 8 bits of its own magnitude (int8 per group of 32 keeps 7
bits of the group's largest): against float64 on the same weights, a 500-row product's
largest error is about 2x smaller than the int8 tiles' on Gaussian activations, 10-15x on
rows with an outlier (`tests/test_amx_prefill.py`). The
manifest says from how many rows (`target.details.prefill_bf16_amx_from_rows`).

Calls of fewer than `MIN_ROWS` token rows (a speculative verification, a prompt's last
rows) take the VNNI tiles: the panel costs as much as many rows of products. Which path a
row takes so depends on the call's row count; deterministic mode runs each sequence's
chunk as a call of its own (`runtime/model_runner.py`), so a token's path is fixed by its
chunk, which the mode's grid fixes.

Linux gives a process the AMX state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
the runtime asks when it reads the CPU's features (`runtime/cpu_features.py`), and a library
holding these kernels records `amx_bf16` among the features it needs, so a machine that
refuses the request refuses the library instead of dying on its first tile instruction.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..tir_common import llvm_has_features
from . import int8_vnni
from .int8_codes import LANES
from .int8_ops import offset_halves
from .int8_prefill import prefill_body, prefill_func

FEATURES = ("amx-tile", "amx-bf16", "avx512bf16")
TILE = 16  # rows of an AMX tile, and its columns of float sums
COLS = 2 * TILE  # output columns per task: two B tiles
ROWS = 128  # token rows a panel of decoded weights serves
PASS = 2 * TILE  # rows a pass of products accumulates (2 x 2 tiles of sums, registers 0-3)
MIN_ROWS = 32  # fewer rows in a call: the VNNI tiles
_A, _B = 4, 6  # registers: the pass's two A tiles, the group's two B tiles


def supported(target) -> bool:
    """Whether `target` (an x86 LLVM target) has AMX tiles with bf16 products."""
    return llvm_has_features(target, FEATURES)


def _c(i: int):
    return tirx.const(i, "int32")


def _void(name: str, *args):
    return T.call_llvm_intrin("void", name, *args)


def _reg(i: int):
    return tirx.const(i, "int8")


def _bf16(lo, hi):
    """uint16x32: float32x16 `lo` then `hi`, rounded to bf16 (to nearest even)."""
    return T.call_llvm_pure_intrin("uint16x32", "llvm.x86.avx512bf16.cvtne2ps2bf16.512", hi, lo)


def _pairs(first, second):
    """int32x16: lane c holds bf16(first[c]) in its low half and bf16(second[c]) above."""
    both = _bf16(first, second)
    return tirx.reinterpret(
        "int32x16", tirx.Shuffle([both], [_c(i // 2 + 16 * (i % 2)) for i in range(32)])
    )


def panel_words(ct, scale_of, offset_of, shift: int, halves: int):
    """16 int32x16, the B tile of a group: word (k, c) holds the group's weights 2k and
    2k + 1 of column c as bf16, decoded from its 8 step vectors in `ct` (vector s: codes
    4s..4s+3 of the 16 columns, a byte each) as `scale_of(h) * (code + shift) + offset_of(h)`
    (`shift` -128 un-flips signed codes in integers: a flipped code's `128 * scale` against
    its offset's `-128 * scale` had left float error enough to round a weight to the other
    bf16 neighbour)."""
    per_scale = 8 // halves
    mask = tirx.Broadcast(_c(0xFF), TILE)
    words = []
    for s in range(8):
        v = ct.vload([s * TILE], "int32x16")
        scale, offset = scale_of(s // per_scale), offset_of(s // per_scale)

        def weight(byte, v=v, scale=scale, offset=offset):
            code = (v >> tirx.Broadcast(_c(8 * byte), TILE)) & mask
            if shift:
                code = code + tirx.Broadcast(_c(shift), TILE)
            return tirx.Cast("float32x16", code) * scale + offset

        words += [_pairs(weight(0), weight(1)), _pairs(weight(2), weight(3))]
    return words


def _panel_hook(halves: int):
    @T.macro
    def write_panel(panel, g, ct, scale_of, offset_of, shift):
        """Group `g`'s B tile at `panel[g * 512]` (a task's panel holds its two column
        tiles' B tiles group by group; the caller's view starts at the tile's)."""
        words = T.meta_var(panel_words(ct, scale_of, offset_of, shift, halves))
        at = T.meta_var(g * 2 * TILE * TILE)
        panel[T.Ramp(at, 1, TILE)] = words[0]
        panel[T.Ramp(at + 16, 1, TILE)] = words[1]
        panel[T.Ramp(at + 32, 1, TILE)] = words[2]
        panel[T.Ramp(at + 48, 1, TILE)] = words[3]
        panel[T.Ramp(at + 64, 1, TILE)] = words[4]
        panel[T.Ramp(at + 80, 1, TILE)] = words[5]
        panel[T.Ramp(at + 96, 1, TILE)] = words[6]
        panel[T.Ramp(at + 112, 1, TILE)] = words[7]
        panel[T.Ramp(at + 128, 1, TILE)] = words[8]
        panel[T.Ramp(at + 144, 1, TILE)] = words[9]
        panel[T.Ramp(at + 160, 1, TILE)] = words[10]
        panel[T.Ramp(at + 176, 1, TILE)] = words[11]
        panel[T.Ramp(at + 192, 1, TILE)] = words[12]
        panel[T.Ramp(at + 208, 1, TILE)] = words[13]
        panel[T.Ramp(at + 224, 1, TILE)] = words[14]
        panel[T.Ramp(at + 240, 1, TILE)] = words[15]

    return write_panel


@T.macro
def configure():
    """Palette 1, all 8 registers 16 rows of 64 bytes, on this thread: a
    task on the thread pool may run on any worker, so every task configures its own."""
    cfg = T.sblock_alloc_buffer((64,), "uint8")
    for i in T.vectorized(64):
        cfg[i] = T.uint8(0)
    cfg[0] = T.uint8(1)
    for t in range(_B + 2):
        cfg[16 + 2 * t] = T.uint8(TILE * 4)  # bytes a row, 2 per register from byte 16
        cfg[48 + t] = T.uint8(TILE)  # rows, 1 per register from byte 48
    T.evaluate(_void("llvm.x86.ldtilecfg", T.address_of(cfg[0])))


def amx_body(qtype: str, n_out: int, k: int):
    """The kernel's body, a macro `(x, w, out, table, tokens)` (`int8_prefill.prefill_func`)."""
    if k % LANES or n_out % COLS:
        raise ValueError(f"AMX prefill needs k % {LANES} == 0 and n % {COLS} == 0")
    groups = k // LANES
    tile = int8_vnni.tile_macro(qtype, groups, _panel_hook(offset_halves(qtype)))
    few_rows = prefill_body(qtype, n_out, k)
    stride = tirx.const(TILE * 4, "int64")  # bytes a row of A (32 bf16), B and the panel's

    @T.macro
    def rows_product(xb, rt, g, q, j):
        """Rows q * 32 + j * 16 .. + 15 (`j` a constant: registers are immediates) times
        group `g`'s two B tiles, loaded already, into sums 2j and 2j + 1."""
        row = T.meta_var((rt * groups + g) * ROWS + q * PASS + j * TILE)
        T.evaluate(
            _void("llvm.x86.tileloadd64", _reg(_A + j), T.address_of(xb[row * LANES]), stride)
        )
        T.evaluate(_void("llvm.x86.tdpbf16ps", _reg(2 * j), _reg(_A + j), _reg(_B)))
        T.evaluate(_void("llvm.x86.tdpbf16ps", _reg(2 * j + 1), _reg(_A + j), _reg(_B + 1)))

    @T.macro
    def finish(acc, q, j, t):
        """Sums 2j + t to rows q * 32 + j * 16.. of `acc` ([ROWS, 32]), columns t * 16.."""
        T.evaluate(
            _void(
                "llvm.x86.tilestored64",
                _reg(2 * j + t),
                T.address_of(acc[(q * PASS + j * TILE) * COLS + t * TILE]),
                tirx.const(COLS * 4, "int64"),
            )
        )

    @T.macro
    def products(xb, panel, acc, rt, q):
        """Rows q * 32 .. q * 32 + 31 of tile `rt` against the whole panel, into `acc`."""
        T.evaluate(_void("llvm.x86.tilezero", _reg(0)))
        T.evaluate(_void("llvm.x86.tilezero", _reg(1)))
        T.evaluate(_void("llvm.x86.tilezero", _reg(2)))
        T.evaluate(_void("llvm.x86.tilezero", _reg(3)))
        for g in range(groups):
            at = T.meta_var(g * 2 * TILE * TILE)
            T.evaluate(_void("llvm.x86.tileloadd64", _reg(_B), T.address_of(panel[at]), stride))
            T.evaluate(
                _void("llvm.x86.tileloadd64", _reg(_B + 1), T.address_of(panel[at + 256]), stride)
            )
            rows_product(xb, rt, g, q, 0)
            rows_product(xb, rt, g, q, 1)
        finish(acc, q, 0, 0)
        finish(acc, q, 0, 1)
        finish(acc, q, 1, 0)
        finish(acc, q, 1, 1)

    @T.macro
    def body(x, w, out, table, tokens):
        if tokens < MIN_ROWS:
            with T.sblock("few_rows"):
                T.reads(x[:, :, :], w[:, :])
                T.writes(out[:, :, :])
                few_rows(x, w, out, table, tokens)
        else:
            with T.sblock("amx"):
                T.reads(x[:, :, :], w[:, :])
                T.writes(out[:, :, :])
                n_tiles = T.meta_var((tokens + ROWS - 1) // ROWS)
                # the activations in bf16 by tile of rows, group, row: [tile, group, row, 32]
                xb = T.sblock_alloc_buffer((n_tiles * groups * ROWS * LANES,), "uint16")
                for r in T.parallel(n_tiles * ROWS):
                    with T.sblock("to_bf16"):
                        T.reads(x[0, r, 0:k])
                        T.writes(xb[:])
                        for g in range(groups):
                            at: T.let[T.int64] = (
                                ((r // ROWS) * groups + g) * ROWS + r % ROWS
                            ) * LANES
                            if r < tokens:
                                xb[T.Ramp(at, 1, LANES)] = _bf16(
                                    x[0, r, T.Ramp(g * LANES, 1, 16)],
                                    x[0, r, T.Ramp(g * LANES + 16, 1, 16)],
                                )
                            else:  # rows past the last: zeros, their sums never read
                                xb[T.Ramp(at, 1, LANES)] = T.Broadcast(T.uint16(0), LANES)
                for rt in range(n_tiles):
                    for nb in T.parallel(n_out // COLS):
                        with T.sblock("dot_amx"):
                            T.reads(w[nb * COLS : nb * COLS + COLS, :], xb[:])
                            T.writes(out[0, :, nb * COLS : nb * COLS + COLS])
                            panel = T.sblock_alloc_buffer((groups * 2 * TILE * TILE,), "int32")
                            acc = T.sblock_alloc_buffer((ROWS * COLS,), "float32")
                            for t in range(2):
                                # the two column tiles' B tiles, interleaved group by group
                                half = T.decl_buffer(
                                    (groups * 2 * TILE * TILE,),
                                    "int32",
                                    data=panel.data,
                                    elem_offset=t * TILE * TILE,
                                )
                                n0 = T.meta_var(nb * COLS + t * TILE)
                                if table is None:
                                    tile(w, n0, 0, 0, None, None, None, half, 0, 0)
                                else:
                                    tile(w, n0, 0, 0, None, None, None, half, 0, 0, table)
                            r0: T.let[T.int64] = rt * ROWS
                            n_rows: T.let[T.int64] = T.min(tokens - r0, ROWS)
                            configure()
                            for q in range((n_rows + PASS - 1) // PASS):
                                products(xb, panel, acc, rt, q)
                            T.evaluate(_void("llvm.x86.tilerelease"))
                            for r in range(n_rows):
                                out[0, r0 + r, T.Ramp(nb * COLS, 1, COLS)] = acc[
                                    T.Ramp(r * COLS, 1, COLS)
                                ]

    return body


def amx_prefill_kernel(qtype: str, n_out: int, k: int):
    """`out[0, t, :] = x[0, t, :] @ dequantize(w)^T` on AMX (the parameters of the
    `quant_matmul` it replaces, as `int8_prefill.prefill_kernel`'s)."""
    return prefill_func(qtype, n_out, k, amx_body(qtype, n_out, k))
