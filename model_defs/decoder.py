"""A dense decoder (RMSNorm, GQA attention on TVM's paged KV cache, gated MLP).

Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3 are this network with parts chosen by the
config (`DecoderConfig`, parts in `parts.py`): qkv bias, per-head q/k norm, RoPE scaling and
per-layer RoPE bases, norm form (`w` or `1 + w`) and placement (pre or sandwich), activation,
embedding scale, attention scale, per-layer sliding windows, attention and final logit
soft-capping. The architecture files choose the config and the weight names; the graph
lives here once.
"""

from __future__ import annotations

import functools

from tvm import relax as rx
from tvm import te
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target

from .config import DecoderConfig
from .kv_cast import CastingKVCache
from .moe import MoEMLP
from .parts import (
    Embedding,
    activation,
    annotate_attention_kernels,
    check_attention_support,
    layer_sm_scale,
    make_norm,
    rope_in_graph,
    softcap,
    take_clamped,
)
from .projections import fused_linear
from .quant_ops import QuantEmbedding, QuantLinear, quant_matmul

# Parameter name -> GGUF block type ("q4_k", ...) for weights stored quantized; absent or
# "none" means a plain float weight of the model's dtype. A fused projection whose parts
# differ maps to one type per part (see `projections.fused_linear`).
QuantTypes = dict[str, str | tuple[str, ...]]

# The exported function names, in the order the manifest lists them, per compile task:
# "generate" (the default) also carries the hidden-state function, so a generation artifact
# serves embeddings too; "embed" has no logits, decode or sampler at all.
HIDDEN_FUNCTION = "batch_prefill_hidden"
TASKS = ("generate", "embed")
EXPORTED_FUNCTIONS = (
    "embed",
    "prefill",
    "decode",
    "batch_prefill",
    "batch_decode",
    HIDDEN_FUNCTION,
    "create_paged_kv_cache",
)
EMBED_FUNCTIONS = ("embed", HIDDEN_FUNCTION, "create_paged_kv_cache")


def static_decode_name(rows: int) -> str:
    """`batch_decode` at a fixed row count (`batch_decode_b8`): a static shape lets every
    quantized matmul take the weights-once matrix-vector schedule (schedules/gpu/quant_gemv.py),
    where the symbolic batch gets dlight's LowBatchGEMV (one pass over the weights per 4 rows)."""
    return f"batch_decode_b{rows}"


class BiasedQuantLinear(QuantLinear):
    """A QuantLinear with an optional float bias (Qwen2's q/k/v); the add fuses as an epilogue."""

    def __init__(self, in_f: int, out_f: int, qtype: str, dtype: str, bias: bool):
        super().__init__(in_f, out_f, qtype, out_dtype=dtype)
        self.bias = nn.Parameter((out_f,), dtype=dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        return y + self.bias if self.bias is not None else y


def all_reduce(x: Tensor, degree: int) -> Tensor:
    """The sum over the workers of a row-parallel projection's partial outputs (o_proj,
    down_proj), each worker having multiplied its share of the inputs (tensor_parallel.py)."""
    return x if degree == 1 else op.ccl_allreduce(x, "sum")


def linear(name: str, in_f: int, out_f: int, bias: bool, dtype: str, quant: QuantTypes):
    qtype = quant.get(f"{name}.weight", "none")
    if qtype == "none":
        return nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    return BiasedQuantLinear(in_f, out_f, qtype, dtype, bias)


class Attention(nn.Module):
    def __init__(
        self, config: DecoderConfig, dtype: str, prefix: str, quant: QuantTypes, layer_id: int
    ):
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_out, kv_out = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v share one matmul (one per run of parts in one format: see projections);
        # the weight converter concatenates the three.
        hidden, bias = config.hidden_size, config.attention_bias
        self.qkv_proj = fused_linear(
            f"{prefix}.qkv_proj", hidden, [q_out, kv_out, kv_out], bias, dtype, quant, linear
        )
        self.o_proj = linear(f"{prefix}.o_proj", q_out, hidden, False, dtype, quant)
        self.tensor_parallel = config.tensor_parallel
        if config.qk_norm:
            eps, offset = config.rms_norm_eps, config.norm_weight_offset
            self.q_norm = make_norm(self.head_dim, eps, offset, dtype)
            self.k_norm = make_norm(self.head_dim, eps, offset, dtype)
        else:
            self.q_norm = None
            self.k_norm = None
        scalar = config.query_pre_attn_scalar
        scale = (scalar if scalar is not None else self.head_dim) ** -0.5
        self.sm_scale = layer_sm_scale(scale, config.layer_window(layer_id) is not None)
        # RoPE in the graph when layers rotate differently (the cache then applies none)
        # (a frequency table: rope.py; else Gemma's per-layer base and linear factor)
        self.rope = config.rope_table() if config.rope_in_graph else None
        if config.rope_in_graph and self.rope is None:
            scaling = config.rope_scaling or {}
            local = config.is_sliding_layer(layer_id)
            factor = 1.0 if local else float(scaling.get("factor", 1.0))
            theta = config.layer_rope_theta(layer_id)
            self.rope = functools.partial(rope_in_graph, theta=theta, factor=factor)

    def forward(self, x: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        b, s, _ = x.shape
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        qkv = op.reshape(self.qkv_proj(x), (b, s, hq + 2 * hkv, d))
        if self.q_norm is not None or self.rope is not None:
            # Qwen3 and Gemma 3 normalise each head of q and k before rotary.
            q, k, v = op.split(qkv, [hq, hq + hkv], axis=2)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rope is not None:
                positions = kv_cache.get_query_positions(b * s)
                q = op.reshape(self.rope(op.reshape(q, (b * s, hq, d)), positions), (b, s, hq, d))
                k = op.reshape(self.rope(op.reshape(k, (b * s, hkv, d)), positions), (b, s, hkv, d))
            qkv = op.concat([q, k, v], dim=2)
        out = kv_cache.attention_with_fused_qkv(layer_id, qkv, hq, sm_scale=self.sm_scale)
        return all_reduce(self.o_proj(op.reshape(out, (b, s, hq * d))), self.tensor_parallel)


class MLP(nn.Module):
    def __init__(
        self,
        config: DecoderConfig,
        dtype: str,
        prefix: str,
        quant: QuantTypes,
        width: int | None = None,  # a shared expert's own width (Qwen2-MoE)
        reduce: bool = True,  # False: the caller all-reduces (a shared expert, with the rest)
    ):
        self.act = config.hidden_act
        hidden, inter = config.hidden_size, width or config.intermediate_size
        self.gate_up_proj = fused_linear(
            f"{prefix}.gate_up_proj", hidden, [inter, inter], False, dtype, quant, linear
        )
        self.down_proj = linear(f"{prefix}.down_proj", inter, hidden, False, dtype, quant)
        self.tensor_parallel = config.tensor_parallel if reduce else 1

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return all_reduce(self.down_proj(activation(gate, self.act) * up), self.tensor_parallel)


class DecoderLayer(nn.Module):
    """Pre-norm (Llama: norm, attention, norm, MLP) or sandwich (Gemma 2/3: each of attention
    and MLP between two norms; `post_attention_layernorm` then follows attention)."""

    def __init__(
        self,
        config: DecoderConfig,
        dtype: str,
        prefix: str,
        quant: QuantTypes,
        layer_id: int,
        target: Target | None = None,  # MoE layers build kernels for it
    ):
        dim, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_weight_offset
        self.input_layernorm = make_norm(dim, eps, offset, dtype)
        self.self_attn = Attention(config, dtype, f"{prefix}.self_attn", quant, layer_id)
        self.post_attention_layernorm = make_norm(dim, eps, offset, dtype)
        if config.is_moe_layer(layer_id):
            self.mlp = MoEMLP(config, dtype, f"{prefix}.mlp", quant, target)
        else:
            self.mlp = MLP(config, dtype, f"{prefix}.mlp", quant)
        self.sandwich = config.norm_placement == "sandwich"
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(dim, eps, offset, dtype)
            self.post_feedforward_layernorm = make_norm(dim, eps, offset, dtype)

    def forward(self, x: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        if self.sandwich:
            attn = self.self_attn(self.input_layernorm(x), kv_cache, layer_id)
            x = x + self.post_attention_layernorm(attn)
            mlp = self.mlp(self.pre_feedforward_layernorm(x))
            return x + self.post_feedforward_layernorm(mlp)
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, layer_id)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    def __init__(
        self,
        config: DecoderConfig,
        dtype: str,
        quant: QuantTypes,
        kv_dtype: str,
        target: Target | None = None,
    ):
        self.kv_dtype = kv_dtype
        vocab, hidden = config.vocab_size, config.hidden_size
        embed_q = quant.get("model.embed_tokens.weight", "none")
        if embed_q == "none":
            self.embed_tokens = Embedding(vocab, hidden, dtype=dtype)
        else:
            self.embed_tokens = QuantEmbedding(vocab, hidden, embed_q, out_dtype=dtype)
        self.layers = nn.ModuleList(
            [
                DecoderLayer(config, dtype, f"model.layers.{i}", quant, i, target)
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = make_norm(hidden, config.rms_norm_eps, config.norm_weight_offset, dtype)

    def forward(self, x: Tensor, kv_cache: PagedKVCache) -> Tensor:
        cache = kv_cache if self.kv_dtype == x.dtype else CastingKVCache(kv_cache, self.kv_dtype)
        for layer_id, layer in enumerate(self.layers):
            x = layer(x, cache, layer_id)
        return self.norm(x)


class DecoderLM(nn.Module):
    """The exported model: token embedding, prefill/decode (single and batched), the final
    hidden states of a prefill (embeddings), KV cache.

    With `task="embed"` only the embedding path is exported and the untied `lm_head` is not
    built at all, so its weights stay out of the artifact.
    """

    def __init__(
        self,
        config: DecoderConfig,
        dtype: str,
        target: Target,
        quant: QuantTypes | None = None,
        task: str = "generate",
        kv_dtype: str | None = None,
    ):
        """`kv_dtype`: the KV cache's dtype (TVM's name), default `dtype`; attention runs in
        it (`kv_cast.CastingKVCache`)."""
        if task not in TASKS:
            raise ValueError(f"unknown compile task {task!r}; choose from {', '.join(TASKS)}")
        quant = dict(quant or {})
        check_attention_support(config, target)
        self.config = config
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.target = target
        self.task = task
        self.model = DecoderBody(config, dtype, quant, self.kv_dtype, target)
        if task == "embed":
            self.lm_head = None  # never called: the embed task exports no logits
        elif not config.tie_word_embeddings:
            vocab, hidden = config.vocab_size, config.hidden_size
            self.lm_head = linear("lm_head", hidden, vocab, False, dtype, quant)
        else:
            self.lm_head = None

    def _logits(self, hidden: Tensor) -> Tensor:
        embed = self.model.embed_tokens
        if self.lm_head is None and isinstance(embed, QuantEmbedding):
            # Tied head over a quantized table: the same blocks, read by a fused matmul.
            vocab = self.config.vocab_size
            logits = quant_matmul(hidden, embed.weight, embed.qtype, vocab, self.dtype)
        elif self.lm_head is None:
            logits = op.matmul(hidden, op.permute_dims(embed.weight))
        else:
            logits = self.lm_head(hidden)
        # Sampling reads float32 logits whatever the compute dtype.
        logits = logits.astype("float32") if logits.dtype != "float32" else logits
        return softcap(logits, self.config.final_logit_softcapping)

    def embed(self, input_ids: Tensor) -> Tensor:
        x = self.model.embed_tokens(input_ids)
        scale = self.config.embed_scale
        # Gemma: times sqrt(hidden), a constant of the model's dtype (as transformers rounds it)
        return x if scale == 1.0 else x * scale

    def prefill(self, input_embed: Tensor, kv_cache: PagedKVCache):
        def last_token(x: te.Tensor):
            b, s, d = x.shape
            return te.compute((b, 1, d), lambda i, _, k: x[i, s - 1, k], name="last_token")

        hidden = self.model(input_embed, kv_cache)
        hidden = op.tensor_expr_op(last_token, name_hint="last_token", args=[hidden])
        return self._logits(hidden), kv_cache

    def decode(self, input_embed: Tensor, kv_cache: PagedKVCache):
        return self._logits(self.model(input_embed, kv_cache)), kv_cache

    def batch_prefill(self, input_embeds: Tensor, logit_positions: Tensor, kv_cache: PagedKVCache):
        hidden = self.model(input_embeds, kv_cache)
        hidden = take_clamped(hidden, logit_positions, axis=1)
        return self._logits(hidden), kv_cache

    def batch_decode(self, input_embeds: Tensor, kv_cache: PagedKVCache):
        return self._logits(self.model(input_embeds, kv_cache)), kv_cache

    def decode_bucket_spec(self, buckets) -> dict:
        """Specs of `batch_decode` at each static row count in `buckets` (the CUDA-graph
        buckets the runtime pads decode steps to), same graph and calling convention."""
        spec = self.get_default_spec()["batch_decode"]
        out = {}
        for rows in buckets:
            name = static_decode_name(int(rows))
            # the exporter finds each function as a method of the module
            setattr(self, name, self.batch_decode)
            embeds = nn.spec.Tensor([int(rows), 1, self.config.hidden_size], self.dtype)
            out[name] = {**spec, "input_embeds": embeds}
        return out

    def batch_prefill_hidden(self, input_embeds: Tensor, kv_cache: PagedKVCache):
        """`batch_prefill`'s calling convention, returning every token's final hidden state
        (after the last norm), float32 `[1, total_tokens, hidden]`: what embeddings pool."""
        hidden = self.model(input_embeds, kv_cache)
        return (hidden.astype("float32") if hidden.dtype != "float32" else hidden), kv_cache

    def create_paged_kv_cache(
        self,
        max_batch_size: rx.Var,
        max_total_seq_len: rx.Var,
        prefill_chunk_size: rx.Var,
        page_size: rx.Var,
        support_sliding_window: rx.Var,
    ) -> PagedKVCache:
        c = self.config
        cache = TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=rx.ShapeExpr([0, c.num_hidden_layers]),
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            qk_head_dim=c.head_dim,
            v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NONE if c.rope_in_graph else RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=c.rope_theta,
            rope_scaling={} if c.rope_in_graph else dict(c.rope_scaling or {}),
            rope_ext_factors=rx.prim_value(0),
            rotary_dim=c.head_dim,
            enable_disaggregation=False,
            dtype=self.kv_dtype,
            target=self.target,
        )
        annotate_attention_kernels(c)
        return cache

    def get_default_spec(self) -> dict:
        hidden, dtype = self.config.hidden_size, self.dtype
        packed = {"param_mode": "packed", "effect_mode": "none"}
        cache = nn.spec.Object(object_type=PagedKVCache)
        spec = {
            "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": packed},
            "prefill": {
                "input_embed": nn.spec.Tensor([1, "seq_len", hidden], dtype),
                "kv_cache": cache,
                "$": packed,
            },
            "decode": {
                "input_embed": nn.spec.Tensor([1, 1, hidden], dtype),
                "kv_cache": cache,
                "$": packed,
            },
            "batch_prefill": {
                "input_embeds": nn.spec.Tensor([1, "seq_len", hidden], dtype),
                "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                "kv_cache": cache,
                "$": packed,
            },
            "batch_decode": {
                "input_embeds": nn.spec.Tensor(["batch_size", 1, hidden], dtype),
                "kv_cache": cache,
                "$": packed,
            },
            HIDDEN_FUNCTION: {
                "input_embeds": nn.spec.Tensor([1, "seq_len", hidden], dtype),
                "kv_cache": cache,
                "$": packed,
            },
            "create_paged_kv_cache": {
                "max_batch_size": int,
                "max_total_seq_len": int,
                "prefill_chunk_size": int,
                "page_size": int,
                "support_sliding_window": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }
        names = EMBED_FUNCTIONS if self.task == "embed" else EXPORTED_FUNCTIONS
        return {name: spec[name] for name in names}
