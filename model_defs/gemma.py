"""Gemma 2 and Gemma 3 (text): the shared decoder with Gemma's parts.

Both: RMSNorm scaling by `1 + w` in float32, sandwich norms, GeLU-tanh gate, embeddings times
sqrt(hidden), attention scale `query_pre_attn_scalar ** -0.5`, tied embeddings, layers that
alternate sliding-window and global attention. Gemma 2 soft-caps attention scores and the
final logits and alternates window/global; Gemma 3 normalises q and k per head, makes every
6th layer global (or as `layer_types` says) and rotates windowed layers with its local base
(`rope_local_base_freq`, 10k) and global ones with `rope_theta` (1M) and optional linear
scaling. `Gemma3ForConditionalGeneration` checkpoints compile their text tower.

GGUF (llama.cpp's converter): norm weights are stored as `1 + w` already; the window
pattern, the local RoPE base and the attention scale are not in the metadata but fixed by
llama.cpp per architecture, and set here the same way.
"""

from __future__ import annotations

from typing import Any

from .config import FULL_ATTENTION, SLIDING_ATTENTION, ConfigError, DecoderConfig
from .config_fields import COMMON_FIELDS
from .decoder import DecoderLM
from .parts import embed_scale_value
from .registry import Architecture
from .weight_map import DENSE_DECODER_GGUF_CONFIG, WeightMap, dense_decoder_gguf_map

# Our own key (not an HF field): the GGUF reader sets it to 0, its norms holding 1 + w.
NORM_OFFSET_KEY = "tallow_norm_weight_offset"

GEMMA_FIELDS = COMMON_FIELDS | {
    "hidden_activation",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
}


def _rope(cfg: dict[str, Any], global_default: float) -> tuple[dict, dict]:
    """(global, local) RoPE settings from `rope_parameters` per layer kind (transformers 5)
    or the older `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    params = cfg.get("rope_parameters") or {}
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        full = dict(params.get(FULL_ATTENTION) or {})
        local = dict(params.get(SLIDING_ATTENTION) or {})
    else:
        full = dict(params) if params else dict(cfg.get("rope_scaling") or {})
        local = {}
    full.setdefault("rope_theta", cfg.get("rope_theta", global_default))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", full["rope_theta"]))
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise ConfigError(
            f"rope_parameters[{SLIDING_ATTENTION!r}]: rope type {local_type!r} on windowed "
            "layers is not supported"
        )
    return full, local


def _gemma_from_hf(cfg: dict[str, Any], gen: int, default_pattern: int) -> DecoderConfig:
    cfg = dict(cfg.get("text_config") or cfg)  # Gemma3ForConditionalGeneration: the text tower
    full, local = _rope(cfg, 1_000_000.0 if gen == 3 else 10_000.0)
    layers = int(cfg["num_hidden_layers"])
    if not cfg.get("layer_types"):
        pattern = int(cfg.get("sliding_window_pattern") or default_pattern)
        cfg["layer_types"] = [
            SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)
        ]
    cfg["hidden_act"] = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    cfg["rope_parameters"] = full
    cfg.pop("rope_theta", None)
    cfg.pop("rope_scaling", None)
    cfg.setdefault("head_dim", 256)
    cfg.setdefault("tie_word_embeddings", True)
    softcaps = {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    if gen == 2:
        softcaps = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    caps = {k: cfg.get(k, v) for k, v in softcaps.items()}
    config = DecoderConfig.from_hf(
        cfg,
        qk_norm=gen == 3,
        norm_weight_offset=float(cfg.get(NORM_OFFSET_KEY, 1.0)),
        norm_placement="sandwich",
        embed_scale=embed_scale_value(int(cfg["hidden_size"])),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        rope_local_theta=float(local["rope_theta"]),
        **{k: (float(v) if v else None) for k, v in caps.items()},
    )
    return config


def gemma2_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    return _gemma_from_hf(cfg, 2, 2)


def gemma3_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    return _gemma_from_hf(cfg, 3, 6)


def _hf_map(prefix: str):
    """HF names under `prefix` ("model." for the causal LMs; multimodal checkpoints keep the
    text tower under "language_model.model.")."""

    def weight_map(config: DecoderConfig) -> WeightMap:
        m: WeightMap = {"model.embed_tokens.weight": [f"{prefix}embed_tokens.weight"]}
        for i in range(config.num_hidden_layers):
            p, src = f"model.layers.{i}", f"{prefix}layers.{i}"
            attn, a = f"{p}.self_attn", f"{src}.self_attn"
            m[f"{attn}.qkv_proj.weight"] = [f"{a}.{x}_proj.weight" for x in "qkv"]
            if config.qk_norm:
                m[f"{attn}.q_norm.weight"] = [f"{a}.q_norm.weight"]
                m[f"{attn}.k_norm.weight"] = [f"{a}.k_norm.weight"]
            m[f"{attn}.o_proj.weight"] = [f"{a}.o_proj.weight"]
            m[f"{p}.mlp.gate_up_proj.weight"] = [
                f"{src}.mlp.gate_proj.weight",
                f"{src}.mlp.up_proj.weight",
            ]
            m[f"{p}.mlp.down_proj.weight"] = [f"{src}.mlp.down_proj.weight"]
            for norm in NORMS:
                m[f"{p}.{norm}.weight"] = [f"{src}.{norm}.weight"]
        m["model.norm.weight"] = [f"{prefix}norm.weight"]
        if not config.tie_word_embeddings:
            m["lm_head.weight"] = ["lm_head.weight"]
        return m

    return weight_map


NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
GGUF_NORMS = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")


def gguf_map(config: DecoderConfig) -> WeightMap:
    """llama.cpp's names: the dense decoder's, with Gemma's four norms per layer."""
    m = dense_decoder_gguf_map(config)
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        for norm, gguf_norm in zip(NORMS, GGUF_NORMS, strict=True):
            m[f"{p}.{norm}.weight"] = [f"{b}.{gguf_norm}.weight"]
    return m


GEMMA_GGUF_CONFIG = {
    **DENSE_DECODER_GGUF_CONFIG,
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}


def gguf_fixup(cfg: dict[str, Any]) -> None:
    """What llama.cpp fixes per architecture instead of storing it (llama-model.cpp):
    norms stored as 1 + w, local RoPE base 10k, the attention scale from head_dim except
    at 27B (hidden / heads; 46 layers for Gemma 2, 62 for Gemma 3)."""
    cfg[NORM_OFFSET_KEY] = 0.0
    cfg["rope_local_base_freq"] = 10_000.0
    big = int(cfg["num_hidden_layers"]) in (46, 62)
    heads = int(cfg["num_attention_heads"])
    per_head = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    cfg["query_pre_attn_scalar"] = int(cfg["hidden_size"]) // heads if big else per_head


class Gemma2ForCausalLM(DecoderLM):
    pass


class Gemma3ForCausalLM(DecoderLM):
    pass


def _arch(name, reader, build, hf_map, gguf_arch=None) -> Architecture:
    gguf = {}
    if gguf_arch:
        gguf = dict(
            gguf_arch=gguf_arch,
            gguf_config_keys=GEMMA_GGUF_CONFIG,
            gguf_weight_map=gguf_map,
            gguf_config_fixup=gguf_fixup,
        )
    return Architecture(name, reader, build, hf_map, config_fields=GEMMA_FIELDS, **gguf)


ARCHITECTURES = [
    _arch("Gemma2ForCausalLM", gemma2_from_hf, Gemma2ForCausalLM, _hf_map("model."), "gemma2"),
    _arch("Gemma3ForCausalLM", gemma3_from_hf, Gemma3ForCausalLM, _hf_map("model."), "gemma3"),
    _arch(
        "Gemma3ForConditionalGeneration",
        gemma3_from_hf,
        Gemma3ForCausalLM,
        _hf_map("language_model.model."),
    ),
]
