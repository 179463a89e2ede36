"""CPU (LLVM) schedule for the fused dequantize-matmul kernels of `model_defs.quant_ops`.

The kernel is one PrimFunc: a spatial block "dequantize" (uint8 GGUF blocks -> float [N, K]),
a reduction block `out[m..., n] = sum_k x[m..., k] * dequantize[n, k]`, and optionally
elementwise epilogue blocks that FuseOps fused in (bias, residual add).

Unscheduled, the dequantize block would write all of W in full precision to a scratch
buffer. Prefill kernels (a symbolic token axis) go to the tiled schedule of `cpu.tiled`.
The matrix-vector schedule here serves decode (one row) and batched decode where the
int8-activation kernels of `cpu.int8_gemv` do not apply (no AVX2, untileable shapes):

* splits N into chunks that run on the thread pool (`parallel`), as the float schedule does;
* tiles the rows of x by `ROWS`, so one decoded piece of W serves `ROWS` sequences in a
  batched decode (rows padded to whole tiles first; with one row the tile shrinks to 1);
* walks K in tiles of 32 weights (a legacy block, a K-quant sub-block) and `compute_at`s the
  dequantize block there: 32 values are decoded into a local buffer (vectorised by the lane
  width, so per-block scales are decoded once per vector, not per weight) and consumed
  straight away by vector FMAs into per-lane partial sums (`rfactor`), reduced at the end.

So W is read once per row tile in its packed form and never stored in float.
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx

from ..tir_common import register_lanes, static_extent
from .tiled import schedule_tiled_matmul, tile_for

log = logging.getLogger(__name__)

ROWS = 8  # rows (sequences) sharing one decoded tile of W in a batched decode
ROW_LANES = 8  # lanes of the partial sums with several rows: 8 accumulator registers
N_CHUNK = 16  # output columns per parallel task
K_TILE = 32  # weights decoded per step: one legacy block / one K-quant sub-block


def _is_quant_matmul(sch: s_tir.Schedule):
    """(dequantize block, matmul block, epilogue blocks, m loops, n loop, k loop) or None."""
    try:
        deq = sch.get_sblock("dequantize")
    except (tvm.TVMError, ValueError, RuntimeError):
        return None
    deq_stmt = sch.get(deq)
    if len(deq_stmt.writes) != 1 or len(deq_stmt.writes[0].source.shape) != 2:
        return None
    if not all(str(r.source.dtype) == "uint8" for r in deq_stmt.reads):
        return None
    if sch.get_producers(deq):
        return None
    consumers = sch.get_consumers(deq)
    if len(consumers) != 1:
        return None
    mm = consumers[0]
    iters = sch.get(mm).iter_vars
    # iter_type 0 = data parallel, 2 = commutative reduction
    if len(iters) < 3 or any(int(v.iter_type) != 0 for v in iters[:-1]):
        return None
    if int(iters[-1].iter_type) != 2:
        return None
    loops = sch.get_loops(mm)
    if len(loops) != len(iters):
        return None
    n_ext = static_extent(sch.get(loops[-2]).extent)
    k_ext = static_extent(sch.get(loops[-1]).extent)
    n_w, k_w = (static_extent(e) for e in deq_stmt.writes[0].source.shape)
    if n_ext is None or k_ext is None or (n_ext, k_ext) != (n_w, k_w) or k_ext % K_TILE:
        return None
    # the only other blocks may be elementwise epilogues hanging off the matmul
    epilogues = []
    frontier = sch.get_consumers(mm)
    while frontier:
        if len(frontier) != 1:
            return None
        epilogues.append(frontier[0])
        frontier = sch.get_consumers(frontier[0])
    n_blocks = 2 + len(epilogues)
    if len(sch.get_child_blocks(sch.get_sblock("root"))) != n_blocks:
        return None
    return deq, mm, epilogues, loops[:-2], loops[-2], loops[-1]


def schedule_quant_matmul(sch: s_tir.Schedule, target=None) -> bool:
    """Schedule `sch` (a fused dequantize-matmul kernel) in place; False if it does not match.

    The matrix-vector schedule below serves a known token count (decode of one sequence)
    and batched decode (`[batch, 1, K]`, a few rows: its rows are padded to whole tiles so
    the tile needs no predicate). Prefill (`[1, tokens, K]`, up to a whole chunk) gets the
    tiled schedule of `cpu.tiled`, which decodes each weight once for all its rows.
    Measured for SmolLM2's gate/up projection: 4 rows 0.50 ms tiled vs 0.25 ms here; the
    engine's 16-sequence decode went from 127 to 142 tok/s with 8-row tiles instead of 4.
    """
    found = _is_quant_matmul(sch)
    if found is None:
        return False
    deq, mm, epilogues, m_loops, n, k = found
    symbolic = [static_extent(sch.get(loop).extent) is None for loop in m_loops]
    copy_out = None
    if any(symbolic):
        batched_decode = len(m_loops) > 1 and static_extent(sch.get(m_loops[-1]).extent) == 1
        if not batched_decode and tile_for(static_extent(sch.get(n).extent)) is not None:
            return schedule_tiled_matmul(sch, mm, deq, epilogues, target)
        if batched_decode and sum(symbolic) == 1:
            sch.pad_einsum(mm, [ROWS if s else 1 for s in symbolic] + [1, 1])
            (copy_out,) = sch.get_consumers(mm)
            *m_loops, n, k = sch.get_loops(mm)
    dtype = str(sch.get(mm).writes[0].source.dtype)
    m = sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0]
    m_ext = static_extent(sch.get(m).extent)
    rows = ROWS if m_ext is None else max(1, min(ROWS, m_ext))
    lanes = min(register_lanes(target, dtype), K_TILE)
    if rows > 1:
        lanes = min(lanes, ROW_LANES)  # rows x lanes partial sums must fit in registers
    mo, mi = sch.split(m, [None, rows])
    no, ni = sch.split(n, [None, N_CHUNK])
    ko, kc, ki = sch.split(k, [None, K_TILE // lanes, lanes])
    sch.reorder(no, mo, ni, ko, mi, kc, ki)
    rf = sch.rfactor(ki, factor_axis=len(sch.get(mm).writes[0].source.shape))
    no, mo, ni, ko, mi, kc, ki = sch.get_loops(rf)
    sch.vectorize(ki)
    sch.unroll(kc)
    sch.unroll(mi)

    # decode one 32-weight tile of one W row right before the FMAs that use it
    sch.compute_at(deq, ko)
    # default scope, not "local": a small stack array; "local" made TVM call its workspace
    # allocator for every tile (4-58% of the kernel by format, outputs identical)
    d_loops = sch.get_loops(deq)[4:]  # below (no, mo, ni, ko): the 32 weights of the tile
    d_fused = sch.fuse(*d_loops) if len(d_loops) > 1 else d_loops[0]
    d_o, d_i = sch.split(d_fused, [None, lanes])
    # vectorised decode measured ~1.2x faster than unrolled scalar and ~5x faster than a plain loop
    sch.vectorize(d_i)
    sch.unroll(d_o)

    sch.reverse_compute_at(mm, ni)
    for block in [copy_out] * (copy_out is not None) + epilogues:
        sch.reverse_compute_at(block, ni)
    sch.parallel(no)  # before decompose_reduction: parallel needs the rf block to keep its init
    sch.decompose_reduction(rf, ko)
    return True


def schedule_func(func: tirx.PrimFunc, target=None) -> tirx.PrimFunc | None:
    """A scheduled copy of `func`, or None if it is not a dequantize-matmul kernel."""
    sch = s_tir.Schedule(func)
    try:
        if not schedule_quant_matmul(sch, target):
            return None
    except Exception as e:  # noqa: BLE001 - a kernel that does not fit stays for other rules
        log.debug("no quantized-matmul schedule: %s", e)
        return None
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def schedule_module(mod: tvm.IRModule, target) -> tvm.IRModule:
    """Schedule every dequantize-matmul kernel in `mod`; other functions are untouched."""
    updated = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs and "tirx.is_scheduled" in func.attrs:
            continue
        scheduled = schedule_func(func, target)
        if scheduled is not None:
            updated[gv] = scheduled
    for gv, func in updated.items():
        mod[gv] = func
    return mod
