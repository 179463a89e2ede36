"""How checkpoint tensors become the compiled model's parameters.

A `WeightMap` maps each parameter name of our module to the checkpoint tensors it is made
of: one name, or several concatenated along axis 0 (fused q/k/v and gate/up projections).
"""

from __future__ import annotations

from .config import DecoderConfig

WeightMap = dict[str, list[str]]


def dense_decoder_hf_map(config: DecoderConfig) -> WeightMap:
    """Hugging Face names used by Llama, Mistral, Qwen2 and Qwen3 checkpoints."""
    m: WeightMap = {"model.embed_tokens.weight": ["model.embed_tokens.weight"]}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = f"{p}.self_attn"
        m[f"{attn}.qkv_proj.weight"] = [f"{attn}.{x}_proj.weight" for x in "qkv"]
        if config.attention_bias:
            m[f"{attn}.qkv_proj.bias"] = [f"{attn}.{x}_proj.bias" for x in "qkv"]
        if config.qk_norm:
            m[f"{attn}.q_norm.weight"] = [f"{attn}.q_norm.weight"]
            m[f"{attn}.k_norm.weight"] = [f"{attn}.k_norm.weight"]
        m[f"{attn}.o_proj.weight"] = [f"{attn}.o_proj.weight"]
        m[f"{p}.mlp.gate_up_proj.weight"] = [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"]
        m[f"{p}.mlp.down_proj.weight"] = [f"{p}.mlp.down_proj.weight"]
        m[f"{p}.input_layernorm.weight"] = [f"{p}.input_layernorm.weight"]
        m[f"{p}.post_attention_layernorm.weight"] = [f"{p}.post_attention_layernorm.weight"]
    m["model.norm.weight"] = ["model.norm.weight"]
    if not config.tie_word_embeddings:
        m["lm_head.weight"] = ["lm_head.weight"]
    return m
