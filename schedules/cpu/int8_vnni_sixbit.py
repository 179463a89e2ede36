"""The VNNI decode tiles of `int8_vnni` for q6k: its codes decoded 128 weights at a time.

q6k keeps a 128-weight half of a super-block as 64 bytes of low nibbles (byte `l` holds
weight `l` in its low nibble and weight `l + 64` in its high one; byte `32 + l` weights
`32 + l` and `96 + l`) and 32 bytes of high bits (byte `l`: the top two bits of weights
`l`, `32 + l`, `64 + l`, `96 + l`). The per-group path decoded each of the 16 columns' 32
codes and transposed them: at 64 rows a tile, that cost as much as a fifth of the group's
`vpdpbusd` work. Here three 32-byte runs are transposed once for the 16 columns
(`int8_columns.transpose`) and serve the 4 groups of the 128 weights, each group's step
vectors then a mask, two shifts and an or away. 500 tokens in 64-row tiles, one thread,
CPU time, best of 7 interleaved rounds in one process (load about 5 on the 2 cores): q6k
8192 -> 2048 (Llama-3.2-1B's down projection) 100 -> 81 ms, 2048 -> 512 6.6 -> 5.8 ms.
`batch_decode`'s 16-column tiles take the same path.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from .int8_codes import codes_of
from .int8_columns import transpose
from .int8_vnni import COLS, HALF, STEPS, _join, store_vectors

QUAD = 4  # groups per 128 weights


def transposed_runs(w, n0, b, half: int, qtype: str):
    """3 lists of 8 int32x16 for rows n0..n0+15 of super-block `b`, half `half`: the
    transposed low-nibble runs (groups 0 and 2, groups 1 and 3), then the high bits."""
    fmt = get_format(qtype)
    low_at, high_at = codes_of(qtype).six_bit_at
    starts = (low_at + 64 * half, low_at + 64 * half + 32, high_at + 32 * half)
    runs = []
    for start in starts:
        parts = []
        for first in (0, HALF):
            raw = [
                tirx.reinterpret(
                    "int32x8", w.vload([n0 + first + c, b * fmt.type_size + start], "uint8x32")
                )
                for c in range(HALF)
            ]
            parts.append(transpose(raw))
        runs.append([_join(lo, hi, HALF) for lo, hi in zip(*parts, strict=True)])
    return runs


def group_steps(lows0, lows1, highs, j):
    """The 8 step vectors of group `j` (0..3, a constant once the tile's loop is unrolled) of
    a 128-weight half, from the stored runs."""
    nibble = tirx.Broadcast(tirx.const(0x0F0F0F0F, "int32"), COLS)
    two_bits = tirx.Broadcast(tirx.const(0x03030303, "int32"), COLS)
    low_shift = tirx.Broadcast(tirx.Cast("int32", j // 2 * 4), COLS)
    high_shift = tirx.Broadcast(tirx.Cast("int32", j * 2), COLS)
    out = []
    for s in range(STEPS):
        low = tirx.Select(
            j % 2 == 0, lows0.vload([s * COLS], "int32x16"), lows1.vload([s * COLS], "int32x16")
        )
        high = highs.vload([s * COLS], "int32x16")
        out.append(
            ((low >> low_shift) & nibble)
            | (((high >> high_shift) & two_bits) << tirx.Broadcast(tirx.const(4, "int32"), COLS))
        )
    return out


def six_bit_tile_macro(qtype: str, groups: int, update, prefetch_group, store_scales, group_hook):
    """`tile_macro` for q6k (`Int8Codes.six_bit_at`): the loop goes over 128-weight halves
    of the super-blocks, 4 groups each, and transposes 3 runs of bytes per half
    (`group_hook`: as `int8_vnni.tile_macro`'s)."""
    per_block = get_format(qtype).block_size // 32
    if per_block != 2 * QUAD:
        raise ValueError(f"{qtype}: six-bit tiles need 256-weight super-blocks")

    def legacy_scale(sc):
        return lambda h: sc.vload([h * COLS], "float32x16")

    def legacy_offset(sc):
        return lambda h: sc.vload([(2 + h) * COLS], "float32x16")

    @T.macro
    def one_group(w, n0, r0, rows, xq, steps, xs, acc, a0, c0, g, ct, sc, lows0, lows1, highs, j):
        for c in T.unroll(COLS):
            T.evaluate(prefetch_group(w, n0 + COLS + c, g))
        tr = T.meta_var(group_steps(lows0, lows1, highs, j))
        store_vectors(ct, tr)
        store_scales(sc, w, n0, g)
        if group_hook is not None:
            group_hook(acc, g, ct, legacy_scale(sc), legacy_offset(sc), 0)
        else:
            for r in range(rows):
                upd = T.meta_var(
                    update(ct, legacy_scale(sc), legacy_offset(sc), xq, steps, xs, r0 + r, g)
                )
                acc[a0 + r, 0, T.Ramp(c0, 1, COLS)] = acc[a0 + r, 0, T.Ramp(c0, 1, COLS)] + upd

    @T.macro
    def tile(w, n0, r0, rows, xq, steps, xs, acc, a0, c0):
        ct = T.sblock_alloc_buffer((STEPS * COLS,), "int32")  # one group's step vectors
        lows0 = T.sblock_alloc_buffer((STEPS * COLS,), "int32")  # transposed runs
        lows1 = T.sblock_alloc_buffer((STEPS * COLS,), "int32")
        highs = T.sblock_alloc_buffer((STEPS * COLS,), "int32")
        sc = T.sblock_alloc_buffer((4 * COLS,), "float32")  # scales lo, hi; offsets lo, hi
        if group_hook is None:
            for r in range(rows):
                acc[a0 + r, 0, T.Ramp(c0, 1, COLS)] = T.Broadcast(T.float32(0), COLS)
        for q in range(groups // QUAD):
            runs = T.meta_var(transposed_runs(w, n0, q // 2, q % 2, qtype))
            store_vectors(lows0, runs[0])
            store_vectors(lows1, runs[1])
            store_vectors(highs, runs[2])
            for j in T.unroll(QUAD):
                one_group(
                    w,
                    n0,
                    r0,
                    rows,
                    xq,
                    steps,
                    xs,
                    acc,
                    a0,
                    c0,
                    q * QUAD + j,
                    ct,
                    sc,
                    lows0,
                    lows1,
                    highs,
                    j,
                )

    return tile
