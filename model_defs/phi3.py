"""Phi-3, Phi-3.5 and Phi-4-mini (`Phi3ForCausalLM`, GGUF `phi3`).

A Llama-shaped decoder whose checkpoints already fuse q/k/v (`qkv_proj`) and gate/up
(`gate_up_proj`, gate first), the layout our decoder computes with; LongRoPE scaling
(`longrope`, formerly `su`) and partial rotary (Phi-4-mini rotates 3/4 of each head) rotate
in the graph from a frequency table (rope.py, which says how the long or short factors are
chosen at compile time); `sliding_window` (Phi-3-mini: 2047) windows every layer, as in
Mistral.

GGUF (llama.cpp's converter): `attn_qkv` and `ffn_up` (gate and up together) tensors, the
LongRoPE factors as `rope_factors_long` / `rope_factors_short` tensors, the pretraining
context and cos/sin multiplier in `rope.scaling.*`, the rotated dimensions in
`rope.dimension_count`, and `attention.sliding_window` 0 for "no window" (Phi-4).
"""

from __future__ import annotations

from typing import Any

from .config import DecoderConfig
from .config_fields import COMMON_FIELDS
from .decoder import DecoderLM
from .registry import Architecture
from .weight_map import DENSE_DECODER_GGUF_CONFIG, WeightMap

PHI3_FIELDS = COMMON_FIELDS | {"original_max_position_embeddings"}


def phi3_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    return DecoderConfig.from_hf(cfg, attention_bias=False, qk_norm=False)


def _map(config: DecoderConfig, names: dict[str, str], layer: str, top: dict[str, str]):
    m: WeightMap = {ours: [theirs] for ours, theirs in top.items()}
    if config.tie_word_embeddings:
        m.pop("lm_head.weight")
    for i in range(config.num_hidden_layers):
        for ours, theirs in names.items():
            m[f"model.layers.{i}.{ours}.weight"] = [f"{layer.format(i)}.{theirs}.weight"]
    return m


_OURS = (
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)
_GGUF = ("attn_qkv", "attn_output", "ffn_up", "ffn_down", "attn_norm", "ffn_norm")


def phi3_hf_map(config: DecoderConfig) -> WeightMap:
    top = {k: k for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    return _map(config, {n: n for n in _OURS}, "model.layers.{}", top)


def phi3_gguf_map(config: DecoderConfig) -> WeightMap:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    return _map(config, dict(zip(_OURS, _GGUF, strict=True)), "blk.{}", top)


PHI3_GGUF_CONFIG = {**DENSE_DECODER_GGUF_CONFIG, "attention.sliding_window": "sliding_window"}


class Phi3ForCausalLM(DecoderLM):
    pass


ARCHITECTURES = [
    Architecture(
        "Phi3ForCausalLM",
        phi3_from_hf,
        Phi3ForCausalLM,
        phi3_hf_map,
        gguf_arch="phi3",
        gguf_config_keys=PHI3_GGUF_CONFIG,
        gguf_weight_map=phi3_gguf_map,
        config_fields=PHI3_FIELDS,
    )
]
