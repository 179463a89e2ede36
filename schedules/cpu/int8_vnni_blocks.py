"""The VNNI decode tiles of `int8_vnni` for the K-quants with one scale per group (q4k,
q5k): the loop walks 256-weight super-blocks, so a block's scales and codes are decoded
for 16 columns once (see `block_tile_macro` and `int8_vnni`'s module doc for the figures).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from .int8_codes import LANES, Row, codes_of
from .int8_columns import transpose
from .int8_ops import offset_halves
from .int8_vnni import COLS, HALF, STEPS, _c, _join, step_vectors, store_vectors


def block_scale_rows(w, n0, b, qtype: str):
    """Super-block `b`'s scales and offsets for rows n0..n0+15, transposed: lists of
    float32x16 (lane c = row n0 + c), one per group: the scales of each half (one list, or
    two with split halves), then the offsets of each half.

    Each row's are decoded as vectors (`Int8Codes.block_scales`), then 8 x 8 transposes
    (`int8_columns.transpose`) turn 16 rows' vectors into per-group vectors of 16 rows.
    """
    fmt = get_format(qtype)
    per_row = [codes_of(qtype).block_scales(Row(w, n0 + c, b * fmt.type_size)) for c in range(COLS)]
    width = get_format(qtype).block_size // LANES * offset_halves(qtype)
    result = ([], [])
    for which in (0, 1):
        for first_lane in range(0, width, 8):
            lane_idx = [_c(first_lane + i) for i in range(8)]
            parts = []
            for first_row in (0, HALF):
                vecs = [
                    tirx.reinterpret(
                        "int32x8", tirx.Shuffle([per_row[first_row + c][which]], lane_idx)
                    )
                    for c in range(HALF)
                ]
                parts.append(transpose(vecs))
            for lo, hi in zip(*parts, strict=True):
                result[which].append(tirx.reinterpret("float32x16", _join(lo, hi, HALF)))
    halves = offset_halves(qtype)
    # by half, then group: [scales h0, scales h1, offsets h0, offsets h1][group]
    return [result[which][h::halves] for which in (0, 1) for h in range(halves)]


def block_tile_macro(qtype: str, groups: int, update, prefetch_group, group_hook=None):
    """`tile_macro` for formats with `block_scales` (the K-quants): the loop goes over
    super-blocks, whose scales and offsets for the 16 columns are decoded and transposed
    once (`block_scale_rows`) into stack arrays that each group reads as vectors. Decoding
    each row's group scale with scalar byte arithmetic had cost more than the group's 128
    `vpdpbusd` of 16 sequences. `group_hook`: as `int8_vnni.tile_macro`'s."""
    fmt = get_format(qtype)
    per_block = fmt.block_size // LANES
    blocks = groups // per_block
    if offset_halves(qtype) != 1 or per_block != 8:
        raise ValueError(f"{qtype}: block tiles need 8 groups a block with one scale each")
    # the block's scales and offsets, 8 groups x 16 columns per array (512 bytes: TVM's
    # stack limit is 1 KiB)
    pairs_at = codes_of(qtype).nibble_pairs_at
    block_bytes = fmt.type_size

    def pair_step_vectors(w, n0, b, p):
        """16 int32x16: the step vectors of groups 2p and 2p + 1 of block `b` (rows
        n0..n0+15), whose codes are the low and high nibbles of the same 32 bytes: one
        transpose of the bytes serves both groups."""
        words = []
        for first in (0, HALF):
            raw = [
                tirx.reinterpret(
                    "int32x8",
                    w.vload([n0 + first + c, b * block_bytes + pairs_at + p * 32], "uint8x32"),
                )
                for c in range(HALF)
            ]
            words.append(transpose(raw))
        joined = [_join(lo, hi, HALF) for lo, hi in zip(*words, strict=True)]
        mask = tirx.Broadcast(tirx.const(0x0F0F0F0F, "int32"), COLS)
        shift = tirx.Broadcast(tirx.const(4, "int32"), COLS)
        return [v & mask for v in joined] + [(v >> shift) & mask for v in joined]

    def unit_scales(s0, o0, u):
        """Group `u` of the block's (scale_of, offset_of), one half."""
        return (
            lambda _h: s0.vload([u * COLS], "float32x16"),
            lambda _h: o0.vload([u * COLS], "float32x16"),
        )

    def group_update(s0, o0, ct, xq, steps, xs, row, b, u):
        scale_of, offset_of = unit_scales(s0, o0, u)
        return update(ct, scale_of, offset_of, xq, steps, xs, row, b * per_block + u)

    @T.macro
    def tile(w, n0, r0, rows, xq, steps, xs, acc, a0, c0):
        ct = T.sblock_alloc_buffer((STEPS * COLS,), "int32")  # transposed codes
        ct2 = T.sblock_alloc_buffer((STEPS * COLS,), "int32")  # the pair's second group
        s0 = T.sblock_alloc_buffer((per_block * COLS,), "float32")  # scales
        o0 = T.sblock_alloc_buffer((per_block * COLS,), "float32")  # offsets
        # the sums accumulate in `acc` (see `int8_vnni.tile_macro`)
        if group_hook is None:
            for r in range(rows):
                acc[a0 + r, 0, T.Ramp(c0, 1, COLS)] = T.Broadcast(T.float32(0), COLS)
        for b in range(blocks):
            sv = T.meta_var(block_scale_rows(w, n0, b, qtype))
            store_vectors(s0, sv[0])
            store_vectors(o0, sv[1])
            if pairs_at is None:
                for u in range(per_block):
                    g: T.let[T.int32] = b * per_block + u
                    for c in T.unroll(COLS):
                        T.evaluate(prefetch_group(w, n0 + COLS + c, g))
                    tr = T.meta_var(step_vectors(w, n0, g, qtype))
                    store_vectors(ct, tr)
                    if group_hook is not None:
                        su = T.meta_var(unit_scales(s0, o0, u))
                        group_hook(acc, g, ct, su[0], su[1], 0)
                    else:
                        for r in range(rows):
                            upd = T.meta_var(group_update(s0, o0, ct, xq, steps, xs, r0 + r, b, u))
                            acc[a0 + r, 0, T.Ramp(c0, 1, COLS)] = (
                                acc[a0 + r, 0, T.Ramp(c0, 1, COLS)] + upd
                            )
            else:
                for p in range(per_block // 2):
                    for c in T.unroll(COLS):
                        T.evaluate(prefetch_group(w, n0 + COLS + c, b * per_block + p * 2))
                    pv = T.meta_var(pair_step_vectors(w, n0, b, p))
                    store_vectors(ct, pv)
                    ct2[T.Ramp(0, 1, 16)] = pv[8]
                    ct2[T.Ramp(16, 1, 16)] = pv[9]
                    ct2[T.Ramp(32, 1, 16)] = pv[10]
                    ct2[T.Ramp(48, 1, 16)] = pv[11]
                    ct2[T.Ramp(64, 1, 16)] = pv[12]
                    ct2[T.Ramp(80, 1, 16)] = pv[13]
                    ct2[T.Ramp(96, 1, 16)] = pv[14]
                    ct2[T.Ramp(112, 1, 16)] = pv[15]
                    if group_hook is not None:
                        lo_s = T.meta_var(unit_scales(s0, o0, p * 2))
                        hi_s = T.meta_var(unit_scales(s0, o0, p * 2 + 1))
                        group_hook(acc, b * per_block + p * 2, ct, lo_s[0], lo_s[1], 0)
                        group_hook(acc, b * per_block + p * 2 + 1, ct2, hi_s[0], hi_s[1], 0)
                    else:
                        for r in range(rows):
                            lo = T.meta_var(
                                group_update(s0, o0, ct, xq, steps, xs, r0 + r, b, p * 2)
                            )
                            hi = T.meta_var(
                                group_update(s0, o0, ct2, xq, steps, xs, r0 + r, b, p * 2 + 1)
                            )
                            acc[a0 + r, 0, T.Ramp(c0, 1, COLS)] = (
                                acc[a0 + r, 0, T.Ramp(c0, 1, COLS)] + lo + hi
                            )

    return tile
