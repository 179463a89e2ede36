"""CPU attention kernels for TVM's paged KV cache, in place of its reference ones.

`TIRPagedKVCache` builds its CPU (llvm) attention kernels as single-threaded scalar loops,
and its paged prefill walks the whole cache capacity for every query row. Measured on
SmolLM2-135M (2 cores): attention was 2.9 s of a 7.2 s prefill of 500 tokens and 19 ms of
a 62 ms decode step at 500 tokens of context. Ours keep the same signatures and the same
results (output, and the log2-sum-exp `lse` that the cache uses to merge partial
attentions): decode's in `cpu.attention_decode`, prefill's (ragged and paged) in
`cpu.attention_prefill` (blocks of query rows as a matrix product) and `cpu.attention_rows`
(a row at a time, for sequences with few new rows); this module swaps them in by the cache
kernels' names.

Two model facts arrive as attributes on the kernels the cache built (model_defs/parts.py):
a sliding window (a query at position p sees keys at positions p - window + 1 .. p, as
transformers masks them; a layer asks for it by passing its scale negated, since one
kernel serves every layer) and an attention-score soft cap (Gemma 2: scores become
cap * tanh(scores / cap)). A windowed query starts at its window's first key row, so a
windowed layer reads at most `window` rows whatever the context. Where our kernels cannot
take a shape (head_dim not a multiple of 8) TVM's stay, and a window or a cap is refused.
"""

from __future__ import annotations

import tvm

from tallow.model_defs.parts import SOFTCAP_ATTR, WINDOW_ATTR

from .attention_decode import LANES, decode_kernel, vector_lanes
from .attention_prefill import prefill_paged, prefill_ragged

# The cache's CPU kernels, by their names in the module (TVM 0.27, non-sliding-window).
DECODE = "batch_decode_paged_kv_cpu"
PREFILL_RAGGED = "batch_prefill_ragged_kv"
PREFILL_PAGED = "batch_prefill_paged_kv_cpu"


def _shape(func, index: int) -> tuple[list, str]:
    buf = func.params[index]  # TVM 0.27 PrimFunc parameters carry their buffer's shape
    return [int(x) if isinstance(x, tvm.tirx.IntImm) else None for x in buf.shape], str(buf.dtype)


def _replacement(name: str, func, target):
    """Our kernel for the cache kernel `name`, sized from its buffers; None if not ours."""
    attrs = func.attrs or {}
    window = int(attrs[WINDOW_ATTR]) if WINDOW_ATTR in attrs else None
    cap = float(attrs[SOFTCAP_ATTR]) if SOFTCAP_ATTR in attrs else None
    ours = None
    if name == DECODE:
        (_, h_q, d), dtype = _shape(func, 0)
        (_, _, h_kv, page_size, _), _ = _shape(func, 1)
        if d % LANES == 0:
            lanes = vector_lanes(target, d)
            ours = decode_kernel(h_kv, h_q, d, dtype, page_size, lanes, window, cap)
    elif name == PREFILL_RAGGED:
        (_, h_q, d), dtype = _shape(func, 0)
        (_, h_kv, d_v), _ = _shape(func, 3)
        if d == d_v and d % LANES == 0:
            lanes = vector_lanes(target, d)
            ours = prefill_ragged(h_kv, h_q, d, dtype, window, cap, lanes)
    elif name == PREFILL_PAGED:
        (_, h_q, d), dtype = _shape(func, 0)
        (_, _, h_kv, page_size, _), _ = _shape(func, 2)
        if d % LANES == 0:
            lanes = vector_lanes(target, d)
            ours = prefill_paged(h_kv, h_q, d, dtype, page_size, window, cap, lanes)
    else:
        return None
    if ours is None and (window is not None or cap is not None):
        # TVM's own kernel would silently attend to everything, uncapped
        raise ValueError(
            f"attention kernel {name}: a sliding window or soft cap needs tallow's CPU "
            f"kernels, which need head_dim a multiple of {LANES}"
        )
    return ours


def replace_attention_kernels(mod: tvm.IRModule, target) -> tvm.IRModule:
    """Swap the KV cache's CPU attention kernels in `mod` for the ones above (with 16-lane
    vectors where `target` has AVX-512)."""
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        ours = _replacement(gv.name_hint, func, target)
        if ours is not None:
            symbol = func.attrs.get("global_symbol") if func.attrs else None
            mod[gv] = ours.with_attr("global_symbol", symbol) if symbol else ours
    return mod
