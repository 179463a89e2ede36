"""The interchangeable parts of the decoder that a family's config chooses.

Norm form (RMSNorm scaling by `w` or `1 + w`), activation, soft-capping, RoPE applied in
the graph (when layers rotate with different settings), and how a layer's attention window
reaches the KV cache's attention kernels.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax as rx
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from .config_fields import ConfigError

# Attributes the decoder puts on the KV cache's attention kernels, read by the CPU kernels
# that replace them (tallow.schedules.cpu.attention): the window of the windowed layers in
# positions, and the attention-score soft cap. One cache serves every layer and its kernels
# see no layer id; what they do see per layer is the attention scale. A windowed layer
# passes its scale negated: the kernels take the magnitude as the scale and the sign as
# "this layer is windowed". Kernels that cannot honour these attributes must refuse them.
WINDOW_ATTR = "tallow.attn_window"
SOFTCAP_ATTR = "tallow.attn_softcap"


def check_attention_support(config, target) -> None:
    """Sliding windows and attention soft-capping live in tallow's CPU attention kernels
    only (schedules/cpu/attention.py); TVM's GPU kernels would silently ignore them."""
    if target.kind.name == "llvm":
        return
    asked = []
    if config.windowed:
        asked.append(f"sliding_window={config.sliding_window}")
    if config.attn_logit_softcapping is not None:
        asked.append(f"attn_logit_softcapping={config.attn_logit_softcapping}")
    if asked:
        raise ConfigError(
            f"{', '.join(asked)}: implemented by the CPU attention kernels only, "
            f"not on the {target.kind.name} target yet"
        )


def annotate_attention_kernels(config) -> None:
    """Mark the cache's attention kernels with the window and soft cap they must honour
    (parts.WINDOW_ATTR, SOFTCAP_ATTR); the kernels that replace them read the marks."""
    window = config.sliding_window if config.windowed else None
    cap = config.attn_logit_softcapping
    if window is None and cap is None:
        return
    bb = rx.BlockBuilder.current()
    for gv, func in list(bb.get().functions_items()):
        if isinstance(func, tvm.tirx.PrimFunc) and "attention" in gv.name_hint:
            if window is not None:
                func = func.with_attr(WINDOW_ATTR, int(window))
            if cap is not None:
                func = func.with_attr(SOFTCAP_ATTR, float(cap))
            bb.update_func(gv, func)


def layer_sm_scale(scale: float, windowed: bool) -> float:
    return -scale if windowed else scale


class RMSNorm(nn.Module):
    """RMSNorm scaling by `offset + w`, computed in float32 whatever the model's dtype.

    Gemma stores w around 0 (offset 1) and computes its norms in float32, casting back
    afterwards; transformers does the same (`Gemma3RMSNorm`). Llama-style norms (offset 0)
    keep TVM's `nn.RMSNorm`, which the CPU schedules recognise.
    """

    def __init__(self, dim: int, eps: float, offset: float, dtype: str):
        self.weight = nn.Parameter((dim,), dtype=dtype)
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        eps, offset = self.eps, self.offset

        def compute(xt: te.Tensor, wt: te.Tensor) -> te.Tensor:
            dim = xt.shape[-1]
            k = te.reduce_axis((0, dim), name="k")
            lead = xt.shape[:-1]
            sq = te.compute(
                lead,
                lambda *i: te.sum(
                    xt[(*i, k)].astype("float32") * xt[(*i, k)].astype("float32"), axis=k
                ),
                name="sum_sq",
            )

            def out(*i):
                inv = tirx.rsqrt(sq[i[:-1]] / tirx.const(int(dim), "float32") + eps)
                scale = wt[i[-1]].astype("float32") + tirx.const(offset, "float32")
                return (xt[i].astype("float32") * inv * scale).astype(xt.dtype)

            return te.compute(xt.shape, out, name="rms_norm_offset")

        return op.tensor_expr_op(compute, name_hint="rms_norm_offset", args=[x, self.weight])


def make_norm(dim: int, eps: float, offset: float, dtype: str) -> nn.Module:
    if offset == 0.0:
        return nn.RMSNorm(dim, -1, eps, bias=False, dtype=dtype)
    return RMSNorm(dim, eps, offset, dtype)


def activation(x: Tensor, name: str) -> Tensor:
    if name == "silu":
        return op.silu(x)
    if name == "gelu_pytorch_tanh":
        return op.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}")  # config validation lists the supported


ROPE_ANGLES_BLOCK = "rope_angles"  # the per-token cos/sin stage of `rope_in_graph`


def softcap(x: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(x / cap): Gemma 2's bound on logits."""
    if cap is None:
        return x
    return op.tanh(x / cap) * cap


def rope_in_graph(x: Tensor, positions: Tensor, theta: float, factor: float) -> Tensor:
    """Rotate-half RoPE of x [tokens, heads, head_dim] at int32 `positions` [tokens].

    Used when layers rotate differently (Gemma 3: base 10k on windowed layers, 1M with an
    optional linear `factor` on global ones); the frequencies are those of transformers'
    default and linear RoPE, in float32. Two stages: each token's cos and sin per dimension
    pair (block `ROPE_ANGLES_BLOCK`), then every head rotated with them; the CPU schedule
    keeps the first at the token (`schedules/cpu/rules.py`), where one stage had called
    libm's pow, cos and sin for every element of every head.
    """

    def compute(xt: te.Tensor, pt: te.Tensor) -> te.Tensor:
        d = int(xt.shape[-1])
        half = d // 2

        def cos_sin(t, i):
            j = i % half
            expo = (j * 2).astype("float32") / tirx.const(d, "float32")
            inv_freq = tirx.const(1.0, "float32") / tirx.power(tirx.const(theta, "float32"), expo)
            angle = pt[t].astype("float32") / tirx.const(factor, "float32") * inv_freq
            return tirx.if_then_else(i < half, tirx.cos(angle), tirx.sin(angle))

        cs = te.compute((xt.shape[0], d), cos_sin, name=ROPE_ANGLES_BLOCK)

        def rotated(t, h, i):
            j = i % half
            other = tirx.if_then_else(i < half, -xt[t, h, i + half], xt[t, h, i - half])
            value = xt[t, h, i].astype("float32") * cs[t, j]
            return (value + other.astype("float32") * cs[t, half + j]).astype(xt.dtype)

        return te.compute(xt.shape, rotated, name="rope")

    return op.tensor_expr_op(compute, name_hint="rope", args=[x, positions])


def embed_scale_value(hidden: int) -> float:
    """Gemma's embedding multiplier sqrt(hidden), as transformers rounds it (float32)."""
    import numpy as np

    return float(np.float32(math.sqrt(hidden)))


def take_clamped(x: Tensor, indices: Tensor, axis: int, name: str = "take") -> Tensor:
    """`op.take` with out-of-range indices clamped ("clip") instead of TVM's default "fast",
    which reads past the tensor on a bad index and warns "Fast mode segfaults when there are
    out-of-bounds indices" at every compile. The clamp is a min/max on each index."""
    from tvm.relax.frontend.nn.core import wrap_nested

    return wrap_nested(rx.op.take(x._expr, indices._expr, axis, mode="clip"), name)


class Embedding(nn.Embedding):
    """nn.Embedding (same parameter), looking rows up with `take_clamped`: a token id past
    the vocabulary reads the last row rather than foreign memory."""

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim == 1:
            return take_clamped(self.weight, x, axis=0)
        flat = take_clamped(self.weight, op.reshape(x, shape=[-1]), axis=0)
        return op.reshape(flat, shape=[*x.shape, self.weight.shape[1]])
