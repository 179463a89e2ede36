"""Prefill matmuls for quantized weights on AVX2 CPUs: int8 activations, column tiles.

Without AVX-512 VNNI, prefill (`[1, tokens, K]` times a quantized `[N, K]` weight) ran the
float tiles of `cpu.tiled`: a chunk of weight rows decoded to float, then one 8-lane FMA per
8 multiply-adds, whatever the format. llama.cpp's AVX2 prefill quantizes the activations to
int8 and multiplies with `pmaddubsw` (16 multiply-adds per instruction). This kernel does the
same with batched decode's AVX2 column tiles (`int8_columns`), which are a small GEMM: a
tile transposes one group of 8 weight rows' codes and serves its rows of activations with
it, one `pmaddubsw` per 4 weights, 8 columns and row.

* Every token row is quantized as `int8_ops` documents (rows in parallel): the numbers
  `batch_decode` uses for the same row.
* Output columns run on the thread pool in blocks of 8, each block over all tokens in tiles
  of `ROWS` rows, so that a group's transpose (24 shuffles, more for the formats whose codes
  are decoded column by column) is shared by 256 rows instead of decode's 16. 500 tokens,
  one thread, CPU time, best of 3 interleaved rounds (AMD EPYC Zen 3, machine shared), 16 /
  32 / 64 / 128 rows a tile: q4k 1024 -> 9728 110 / 99 / 84 / 84 ms, q5_0 896 -> 9728
  105 / 89 / 80 / 82 ms, q6k 4864 -> 896 81 / 75 / 67 / 56 ms, q4k 3072 -> 5120
  177 / 158 / 141 / 132 ms; with the layout below (Intel Xeon, x86-64-v3 build), 64 / 128 /
  256: q4k 3072 -> 16384 340 / 305 / 290 ms, q6k 8192 -> 3072 250 / 228 / 201 ms. The
  tile's sums (2 x 256 x 8 floats, 16 KiB) stay on the stack.
* The quantized activations are kept group-major (`xq[group, token, 32]`, `xm` alike), so a
  tile walking its rows through one group reads 32 contiguous bytes a row. Token-major, each
  row of a group was 3-8 KiB from the last (a new page every row or two, and at 3B shapes
  the 256 rows' codes and multipliers, 0.8 MiB, outgrew a Zen 3's L2): Llama 3.2 3B's
  shapes, 500 tokens, one thread, CPU time, best of 3 interleaved (Intel Xeon, x86-64-v3
  build, 128-row tiles both), token-major -> group-major, ms: q4k q/k/v 156 -> 97, o 95 ->
  59, gate/up 488 -> 305, down 309 -> 169; q6k 201 -> 123, 123 -> 75, 626 -> 386, 359 ->
  205; q5_0 and q8_0 the same 1.6-1.85x. Results bit for bit the same.
* The tiles of rows are the outer loop and the column blocks the parallel inner one, and a
  row's multiplier `m` is one 32-bit word per group (`int8_ops.WORD_LANES`, broadcast by a
  load) where it was 32 bytes: a tile's activations (256 rows, 3B shapes) are 0.9 MB, not
  1.5, and stay in a core's L2 while every column block passes over them. Column blocks
  outermost, each walked all the prompt's tiles (3 MB at 500 tokens) and read them from L3.
  The formats that apply `m` in float (`int8_columns.multiplier_in_int32` false: q5k, q6k)
  get it as a float per row and group (`xf`), converted once here rather than per column
  block in the tile, and the tile adds each product term with its own FMA. Llama 3.2 3B's
  shapes, 500 tokens, 2 threads, best of 5 interleaved (Intel Xeon, x86-64-v3 build), ms,
  before -> after: q4k q/k/v 37.1 -> 30.4, o 22.5 -> 18.2, gate/up 117.3 -> 94.6, down
  63.8 -> 54.0; q6k down 81.3 -> 71.6, q/k/v 49.7 -> 41.4; q5k gate/up 136.9 -> 109.2,
  down 72.0 -> 60.7; q5_0 gate/up 135.6 -> 106.3; q8_0 q/k/v 61.7 -> 56.7. The model's
  Q4_K_M prefill: 57.5-58.6 -> 73.5-73.8 tok/s (docs/benchmarks.md).
* Each row and column sums its groups in order into one float whatever the tile's row count
  or the row's place in it: a token's result does not depend on the chunk it is prefilled
  in (`--deterministic`), and it is bit for bit what `batch_decode` gives the same row for
  the formats that take the column tiles there (`Int8Codes.column_tiles`).

Which formats: those whose codes are unsigned with a known `max_code` (the column tiles sum
`pmaddubsw` pairs in int16 and size those sums by it): q4_0, q4_1, q5_0, q5_1 and every
K-quant; and the signed ones (q8_0, iq4_nl, iq4_xs, mxfp4, nvfp4) through the sign
trick: the tile keeps |code| and the codes, and `psignb` moves each code's sign onto the
broadcast activations (one instruction per step and row more; made unsigned, `code + 128`
would overflow the int16 pairs). Their pairs reach 2 x 127 x 127, so each step is widened
at once. Llama 3.2 3B's shapes, 500 tokens, one thread, CPU time, best of 3 interleaved
rounds (AMD EPYC Zen 3, quiet), float tiles -> these: iq4_xs q/k/v 276 -> 187 ms, o 131 ->
113, gate/up 852 -> 599, down 372 -> 374; q8_0 261 -> 184, 124 -> 109, 842 -> 612, 347 ->
353 (q4k, unsigned: 274 -> 140, 130 -> 73, 885 -> 388, 375 -> 216). Everything on CPUs
without AVX2 keeps the float tiles.

The lattice i-quants (iq3_s, iq3_xxs, the IQ2 types, iq1_s) take the column tiles with their
grid as a third input (x, w, table, out), as the fused kernel did: each of a tile's 8 rows'
codes is decoded once a group into a stack buffer and transposed from there (as in the VNNI
tiles). Their codes are grid values with signs, bounded by the grid's largest entry, so the
tiles size the int16 sums by that (`int8_columns.code_bound`), and iq3_s's (odd values up to
15) and iq1_s's are taken unsigned, `(code + 15) / 2` as a 4-bit format's with the bias in
the offset (`int8_columns.unsigned_view`): no `psignb`, 8 steps in int16, the multiplier in
int32. Llama 3.2 3B's IQ3_M file (iq3_s in q/k/v, gate/up and down), 500 tokens, 2 threads,
Intel Xeon, x86-64-v3 build, ms per call in one profiled prefill (`prefill_profile.py`),
float tiles -> column tiles with the sign trick -> unsigned: gate/up 323 -> 199 -> 101, down
(+ residual) 134 -> 103 -> 60, q/k/v 81 -> 49 -> 26 (q4k's gate/up: 95); the whole prefill
16.2 -> 10.6 -> 6.6 s, 31 -> 47 -> 76 tok/s.

Numerics: as `batch_decode`'s, not float; the manifest says so
(`target.details.prefill_activations`). Tests compare with numpy on gguf's dequantizers,
rounding mirrored (`tests/test_int8_prefill.py`).
"""

from __future__ import annotations

from tvm.script import tirx as T

from tallow.compiler.quant.registry import get_format

from . import int8_columns
from .int8_codes import LANES
from .int8_ops import WORD_LANES, offset_halves, quantize_macro
from .int8_prefill import prefill_func

COLS = int8_columns.COLS  # output columns per tile and per parallel task
ROWS = 256  # token rows sharing one transposed group of codes


def supported(qtype: str) -> bool:
    """Whether the AVX2 column tiles can take `qtype`: unsigned codes of known range, or
    signed codes (the i-quants, lattice ones included, and q8_0) through the sign trick."""
    codes = get_format(qtype).int8
    return codes is not None and (codes.signed or codes.max_code is not None)


def prefill_kernel(qtype: str, n_out: int, k: int, rows: int = ROWS):
    """`out[0, t, :] = x[0, t, :] @ dequantize(w)^T` for a symbolic token count.

    Same parameters as the `quant_matmul` PrimFunc it replaces: (x, w, out), or (x, w,
    table, out) for a format with a constant table (the lattice i-quants' grids)."""
    if k % LANES or n_out % COLS:
        raise ValueError(f"int8 prefill needs k % {LANES} == 0 and n % {COLS} == 0")
    if not supported(qtype):
        raise ValueError(f"{qtype} has no AVX2 column tiles")
    groups = k // LANES
    rb = get_format(qtype).row_bytes(k)
    halves = offset_halves(qtype)
    quantize = quantize_macro(groups, halves, group_major=True)
    tile = int8_columns.tile_macro(qtype, groups, rows, group_major=True)
    # the formats that apply the activations' multiplier in float get it as a float, once per
    # row and group (the tile then broadcasts it with a load, not a load and two converts)
    float_m = not int8_columns.multiplier_in_int32(qtype)

    @T.macro
    def body(x, w, out, table, tokens):
        # the decode macros' view: one row per token
        rows_in = T.decl_buffer((tokens, T.int64(1), k), "float32", data=x.data)
        rows_out = T.decl_buffer((tokens, T.int64(1), n_out), "float32", data=out.data)
        xq = T.sblock_alloc_buffer((groups, tokens, LANES), "int8")
        xm = T.sblock_alloc_buffer((groups, tokens, WORD_LANES), "int16")
        xr = T.sblock_alloc_buffer((tokens,), "float32")
        xs = T.sblock_alloc_buffer((groups * halves, tokens), "float32")
        xf = T.sblock_alloc_buffer((groups if float_m else 1, tokens), "float32")
        for r in T.parallel(tokens):
            with T.sblock("quantize"):
                T.reads(rows_in[r, 0, 0:k])
                T.writes(xq[:, r, :], xm[:, r, :], xr[r], xs[:, r], xf[:, r])
                quantize(rows_in, r, xq, xm, xr, xs)
                if float_m:
                    for g in range(groups):
                        xf[g, r] = T.Cast("float32", xm[g, r, 0])
        for rt in range((tokens + rows - 1) // rows):
            for nb in T.parallel(n_out // COLS):
                with T.sblock("dot_columns"):
                    T.reads(
                        w[nb * COLS : nb * COLS + COLS, 0:rb],
                        xq[:, :, :],
                        xm[:, :, :],
                        xf[:, :],
                        xr[:],
                        xs[:, :],
                    )
                    T.writes(rows_out[:, 0, nb * COLS : nb * COLS + COLS])
                    r0: T.let[T.int64] = rt * rows
                    mult = T.meta_var(xf if float_m else xm)
                    tile(
                        w,
                        nb * COLS,
                        r0,
                        T.min(tokens - r0, rows),
                        xq,
                        mult,
                        xr,
                        xs,
                        rows_out,
                        table,
                    )

    return prefill_func(qtype, n_out, k, body)
