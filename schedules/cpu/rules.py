"""CPU (LLVM) schedules: multi-threaded, vectorised matmuls; parallel elementwise kernels.

TVM's generic CPU pipeline leaves every kernel as a single-threaded scalar loop nest. The
weights' matmuls dominate decode and prefill, so they get a real schedule:

* `x @ W^T` with W row-major [N, K]: each output is a dot product over contiguous K, so
  K is split by the vector width and `rfactor`ed into vector partial sums (an 8-wide FMA per
  step), reduced once at the end. Rows of x are tiled by `ROWS` so that one pass over a
  weight row serves several tokens during prefill (weights are the memory traffic).
* The N axis is split into chunks that run on the thread pool.

The KV cache's attention and RoPE kernels are replaced by ours (`cpu.attention`,
`cpu.rope`); row norms (a sum over the last axis, then an elementwise pass) get vector
partial sums (`cpu.norm`); other injective kernels get their last axis vectorised and their
outer axes parallelised.
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial

from ..tir_common import register_lanes, static_extent
from .norm import schedule_row_reduction
from .tiled import schedule_tiled_matmul

log = logging.getLogger(__name__)

ROWS = 4  # token rows sharing one pass over the weights in prefill
N_CHUNK = 16  # output columns per parallel task
MIN_PARALLEL = 4096  # elementwise kernels smaller than this stay on one thread


def _schedule_matmul(sch: s_tir.Schedule, infos, target) -> bool:
    """`out[m..., n] = sum_k a[m..., k] * b[n, k]` (+ an optional elementwise epilogue)."""
    main = infos[0]
    kinds = main.dom_kind()
    if not kinds.endswith("R") or kinds.count("R") != 1 or len(kinds) < 2:
        return False
    block = main.block_rv
    loops = sch.get_loops(block)
    if len(loops) != len(kinds):
        return False
    k_extent = static_extent(sch.get(loops[-1]).extent)
    n_extent = static_extent(sch.get(loops[-2]).extent)
    dtype = str(sch.get(block).writes[0].source.dtype)
    lanes = register_lanes(target, "float32")
    if k_extent is None or n_extent is None or k_extent % lanes:
        return False
    if dtype not in ("float32", "float16"):  # LLVM has no vector bf16 arithmetic on x86
        return False
    *m_loops, n, k = loops
    if not m_loops:
        return False
    if dtype == "float32" and any(static_extent(sch.get(loop).extent) is None for loop in m_loops):
        epilogues = [info.block_rv for info in infos[1:]]
        if schedule_tiled_matmul(sch, block, None, epilogues, target):
            return True
    m = sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0]
    mo, mi = sch.split(m, [None, ROWS])
    no, ni = sch.split(n, [None, N_CHUNK])
    ko, ki = sch.split(k, [None, lanes])
    sch.reorder(no, mo, ni, ko, mi, ki)
    rf = sch.rfactor(ki, factor_axis=len(m_loops) + 1)
    # rf block: partial[m, n, ki] over ko; loops (no, mo, ni, ko, mi, ki)
    rf_loops = sch.get_loops(rf)
    sch.vectorize(rf_loops[-1])
    sch.unroll(rf_loops[-2])
    sch.reverse_compute_at(block, rf_loops[2])
    sch.parallel(rf_loops[0])
    sch.decompose_reduction(rf, rf_loops[3])
    if len(infos) == 2:  # bias add etc.
        sch.reverse_compute_at(infos[1].block_rv, rf_loops[2])
    return True


def _schedule_elementwise(sch: s_tir.Schedule, infos, target) -> bool:
    """Injective kernels: the innermost axis in vectors, the outer axes on the thread pool.

    Fusing all axes into one would make every element pay an int64 division and modulo to
    recover its indices, and a tail predicate that stops vectorisation: SiLU over 16 x 1536
    took 120 us that way.
    """
    if len(infos) != 1 or not infos[0].is_injective():
        return False
    block = infos[0].block_rv
    loops = sch.get_loops(block)
    if not loops:
        return False
    *outer, inner = loops
    lanes = register_lanes(target, str(sch.get(block).writes[0].source.dtype))
    inner_extent = static_extent(sch.get(inner).extent)
    if inner_extent is not None and inner_extent % lanes == 0:
        _, vec = sch.split(inner, [None, lanes])
        sch.vectorize(vec)
        if outer:
            rows = sch.fuse(*outer) if len(outer) > 1 else outer[0]
            n_rows = static_extent(sch.get(rows).extent)
            if n_rows is None or (n_rows > 1 and n_rows * inner_extent >= MIN_PARALLEL):
                sch.parallel(rows)
        return True
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    extent = static_extent(sch.get(fused).extent)
    if extent is not None and extent < MIN_PARALLEL:
        return False
    outer_loop, _ = sch.split(fused, [None, 1024])
    sch.parallel(outer_loop)
    return True


def _schedule_row_norm(sch: s_tir.Schedule, infos, target) -> bool:
    return schedule_row_reduction(sch, infos, register_lanes(target, "float32"))


def _schedule_rope_in_graph(sch: s_tir.Schedule, target) -> bool:
    """`model_defs.parts.rope_in_graph`: a token's cos/sin row computed at the token, then
    every head rotated in vectors; tokens on the thread pool. (Inlined, as the generic rule
    would, each element called pow, cos and sin: Gemma 3 270M's q and k rotations took
    about a fifth of a 500-token prefill.)"""
    from tallow.model_defs.parts import ROPE_ANGLES_BLOCK

    try:
        angles = sch.get_sblock(ROPE_ANGLES_BLOCK)
        rotate = sch.get_sblock("rope")
    except Exception:  # noqa: BLE001 - not that kernel
        return False
    loops = sch.get_loops(rotate)
    lanes = register_lanes(target, "float32")
    if len(loops) != 3 or (static_extent(sch.get(loops[2]).extent) or 1) % lanes:
        return False
    token, _, dim = loops
    sch.compute_at(angles, token)
    _, vec = sch.split(dim, [None, lanes])
    sch.vectorize(vec)
    sch.parallel(token)
    return True


def _schedule_func(func: tirx.PrimFunc, target) -> tirx.PrimFunc | None:
    sch = s_tir.Schedule(func)
    try:
        trial = sch.copy()
        if _schedule_rope_in_graph(trial, target):
            return trial.mod["main"]
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        infos = try_inline_contiguous_spatial(sch, infos)
        if infos is None:
            return None
        for rule in (_schedule_row_norm, _schedule_matmul, _schedule_elementwise):
            trial = sch.copy()
            if rule(trial, infos, target):
                return trial.mod["main"]
    except Exception as e:  # a rule that does not fit raises; the kernel stays unscheduled
        log.debug("no CPU schedule for a kernel: %s", e)
    return None


def schedule_module(mod: tvm.IRModule, target) -> tvm.IRModule:
    # Quantized matmuls first: the float rule below would also match them, but would decode
    # every weight inside the K loop instead of a block at a time.
    from . import attention, quant, rope

    mod = attention.replace_attention_kernels(mod, target)
    mod = rope.replace_rope_kernel(mod)
    mod = quant.schedule_module(mod, target)
    updated = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs and "tirx.is_scheduled" in func.attrs:
            continue
        scheduled = _schedule_func(func, target)
        if scheduled is not None:
            updated[gv] = scheduled.with_attr("tirx.is_scheduled", True)
    for gv, func in updated.items():
        mod[gv] = func
    return mod
