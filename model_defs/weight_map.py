"""How checkpoint tensors become the compiled model's parameters.

A `WeightMap` maps each parameter name of our module to the checkpoint tensors it is made
of: one name, or several concatenated along axis 0 (fused q/k/v and gate/up projections).
When the parts of a fused weight are stored in different formats, the compiler's weight plan
splits its entry into runs (`part_runs`, `run_param`).
"""

from __future__ import annotations

from .config import DecoderConfig

WeightMap = dict[str, list[str]]

FLOAT = "none"  # the type of a part stored as a plain float weight of the model's dtype


def part_runs(part_types) -> list[tuple[int, int, str]]:
    """Consecutive parts of one type, as (first part, end part, type), in order: the
    matmuls of a fused projection whose parts are stored in different formats.

    >>> part_runs(["q5_0", "q5_0", "q8_0"])
    [(0, 2, 'q5_0'), (2, 3, 'q8_0')]
    """
    runs: list[tuple[int, int, str]] = []
    for i, t in enumerate(part_types):
        if runs and runs[-1][2] == t:
            runs[-1] = (runs[-1][0], i + 1, t)
        else:
            runs.append((i, i + 1, t))
    return runs


def run_param(fused_param: str, index: int) -> str:
    """The parameter holding run `index` of the fused weight `fused_param` ("P.weight" ->
    "P.runs.{index}.weight", the name `projections.SplitProjection` gives it)."""
    if not fused_param.endswith(".weight"):
        raise ValueError(f"{fused_param!r}: a fused projection's weight ends in '.weight'")
    return f"{fused_param.removesuffix('.weight')}.runs.{index}.weight"


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


def dense_decoder_gguf_map(config: DecoderConfig) -> WeightMap:
    """llama.cpp's GGUF tensor names for the same dense decoder."""
    m: WeightMap = {"model.embed_tokens.weight": ["token_embd.weight"]}
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        attn = f"{p}.self_attn"
        m[f"{attn}.qkv_proj.weight"] = [f"{b}.attn_{x}.weight" for x in "qkv"]
        if config.attention_bias:
            m[f"{attn}.qkv_proj.bias"] = [f"{b}.attn_{x}.bias" for x in "qkv"]
        if config.qk_norm:
            m[f"{attn}.q_norm.weight"] = [f"{b}.attn_q_norm.weight"]
            m[f"{attn}.k_norm.weight"] = [f"{b}.attn_k_norm.weight"]
        m[f"{attn}.o_proj.weight"] = [f"{b}.attn_output.weight"]
        m[f"{p}.mlp.gate_up_proj.weight"] = [f"{b}.ffn_gate.weight", f"{b}.ffn_up.weight"]
        m[f"{p}.mlp.down_proj.weight"] = [f"{b}.ffn_down.weight"]
        m[f"{p}.input_layernorm.weight"] = [f"{b}.attn_norm.weight"]
        m[f"{p}.post_attention_layernorm.weight"] = [f"{b}.ffn_norm.weight"]
    m["model.norm.weight"] = ["output_norm.weight"]
    if not config.tie_word_embeddings:
        m["lm_head.weight"] = ["output.weight"]
    return m


# GGUF metadata key (after the "<arch>." prefix) -> HF config.json field, for dense decoders.
DENSE_DECODER_GGUF_CONFIG = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
