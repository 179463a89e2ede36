"""RoPE from a per-dimension frequency table, applied in the graph.

Used where the KV cache's one-setting RoPE kernel cannot express the rotation:
- per-dimension frequency divisors (llama.cpp's `rope_freqs` tensor of a Llama 3.1+ GGUF,
  which replaces the llama3 scaling parameters the metadata does not keep),
- LongRoPE (`longrope`, formerly `su`: Phi-3, 3.5, Phi-4-mini): short and long divisors
  plus a cos/sin multiplier,
- partial rotary (`partial_rotary_factor` < 1: only the first dimensions of each head
  rotate; Phi-4-mini rotates 96 of 128).

LongRoPE in transformers switches from the short to the long factors once the running
sequence passes `original_max_position_embeddings`, and recomputes its whole cache when it
does. A compiled model has a fixed context window and a cache that is never recomputed, so
the choice is made once at compile time, as llama.cpp makes it when it loads a model: the
long factors when the compiled context window exceeds `original_max_position_embeddings`,
else the short ones. A model compiled with its full long context thus rotates short prompts
with the long factors, where transformers would use the short ones; compile with
`--context-window` at most `original_max_position_embeddings` to get the short factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op


@dataclass(frozen=True)
class RopeTable:
    """Inverse frequencies of the rotated dimension pairs and the cos/sin multiplier."""

    inv_freq: np.ndarray  # float32 [rotary_dim // 2]
    attention_factor: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])

    def __call__(self, x: Tensor, positions: Tensor) -> Tensor:
        return rope_table_in_graph(x, positions, self)


def inverse_frequencies(theta: float, rotary_dim: int, divisors=None) -> np.ndarray:
    """1 / (divisor_i * theta ** (2i / rotary_dim)) in float32, as transformers computes
    them (its default, LongRoPE and partial-rotary tables alike)."""
    expo = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    base = np.float32(theta) ** expo
    if divisors is not None:
        base = np.asarray(divisors, dtype=np.float32) * base
    return (np.float32(1.0) / base).astype(np.float32)


def longrope_factors(scaling: dict, context_window: int) -> tuple[list[float], float]:
    """(the divisors chosen for `context_window`, the cos/sin multiplier).

    `scaling` holds long_factor, short_factor, original_max_position_embeddings and `factor`
    (the model's max_position_embeddings over the original, set by the config reader);
    the multiplier is `attention_factor` when given, else sqrt(1 + ln f / ln original).
    """
    original = int(scaling["original_max_position_embeddings"])
    factors = scaling["long_factor"] if context_window > original else scaling["short_factor"]
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = float(scaling.get("factor") or 1.0)
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return list(factors), float(attention)


def rope_table_in_graph(x: Tensor, positions: Tensor, table: RopeTable) -> Tensor:
    """Rotate-half RoPE of x [tokens, heads, head_dim] at int32 `positions` [tokens] on the
    first `table.rotary_dim` dimensions; the rest pass through unchanged."""
    rot = table.rotary_dim
    half = rot // 2
    af = float(table.attention_factor)
    freqs = nn.Tensor.from_const(table.inv_freq)

    def compute(xt: te.Tensor, pt: te.Tensor, ft: te.Tensor) -> te.Tensor:
        def rotated(t, h, i):
            j = i % half
            angle = pt[t].astype("float32") * ft[j]
            cos = tirx.cos(angle) * tirx.const(af, "float32")
            sin = tirx.sin(angle) * tirx.const(af, "float32")
            # the partner index stays in bounds for the pass-through dimensions too
            partner = tirx.if_then_else(
                i < half, -xt[t, h, tirx.min(i + half, rot - 1)], xt[t, h, tirx.max(i - half, 0)]
            )
            value = xt[t, h, i].astype("float32") * cos + partner.astype("float32") * sin
            return tirx.if_then_else(i < rot, value.astype(xt.dtype), xt[t, h, i])

        return te.compute(xt.shape, rotated, name="rope_table")

    return op.tensor_expr_op(compute, name_hint="rope_table", args=[x, positions, freqs])
