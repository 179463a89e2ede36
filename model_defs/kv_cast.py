"""A KV cache of another dtype than the activations (`tallow compile --kv-dtype`).

TVM 0.27's paged KV cache takes one dtype for the query, the cached keys and values and the
attention output (see `compiler/kv_layout.py`). A cache of another dtype is therefore used
through this view: q, k and v are cast to the cache's dtype before attention (so RoPE, the
append and the attention itself run in it) and the output is cast back to the activations'
dtype. The layers call it as they call the cache.
"""

from __future__ import annotations

from tvm.relax.frontend.nn import Tensor
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache


class CastingKVCache:
    """`cache` (holding `kv_dtype` values) seen by layers computing in another dtype."""

    def __init__(self, cache: PagedKVCache, kv_dtype: str):
        self.cache = cache
        self.kv_dtype = kv_dtype

    def attention_with_fused_qkv(self, layer_id: int, qkv: Tensor, num_qo_heads: int, sm_scale):
        out = self.cache.attention_with_fused_qkv(
            layer_id, qkv.astype(self.kv_dtype), num_qo_heads, sm_scale=sm_scale
        )
        return out.astype(qkv.dtype)

    def get_query_positions(self, total_length) -> Tensor:
        return self.cache.get_query_positions(total_length)
