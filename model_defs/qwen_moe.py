"""Qwen3-MoE (`Qwen3MoeForCausalLM`, GGUF `qwen3moe`) and Qwen2-MoE (`Qwen2MoeForCausalLM`):
Qwen3's attention (per-head q/k norm) or Qwen2's (q/k/v biases, `qkv_bias`) with
mixture-of-experts feed-forward layers (moe.py): a softmax router, the top
`num_experts_per_tok` experts per token, their weights renormalised when `norm_topk_prob`;
Qwen2-MoE adds a shared expert scaled by a sigmoid gate. Layers listed in
`mlp_only_layers`, and those off the `decoder_sparse_step` grid, keep a dense MLP, as in
transformers.

GGUF (llama.cpp, `qwen3moe` and `qwen2moe`): the experts as stacked `ffn_gate_exps` /
`ffn_up_exps` / `ffn_down_exps` tensors, the router as `ffn_gate_inp`, Qwen2-MoE's shared
expert as `ffn_*_shexp` and its gate as the vector `ffn_gate_inp_shexp`; every layer is a
MoE layer, and llama.cpp fixes the renormalisation per architecture (qwen3moe: on,
qwen2moe: off).
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, DecoderConfig
from .decoder import DecoderLM
from .moe import gguf_experts, with_moe_layers
from .qwen2 import QWEN_FIELDS
from .registry import Architecture
from .weight_map import (
    DENSE_DECODER_GGUF_CONFIG,
    dense_decoder_gguf_map,
    dense_decoder_hf_map,
)

QWEN3_MOE_FIELDS = QWEN_FIELDS | {
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",  # training loss only
    "output_router_logits",  # training output only
}


QWEN2_MOE_FIELDS = QWEN3_MOE_FIELDS | {"qkv_bias", "shared_expert_intermediate_size"}


def qwen3_moe_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    return _qwen_moe_from_hf(cfg, qk_norm=True)


def qwen2_moe_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    return _qwen_moe_from_hf(
        cfg,
        qk_norm=False,
        attention_bias=bool(cfg.get("qkv_bias", True)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )


def _qwen_moe_from_hf(cfg: dict[str, Any], **family: Any) -> DecoderConfig:
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        raise ConfigError(f"{cfg['architectures'][0]}: num_experts is not set")
    layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    moe_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return DecoderConfig.from_hf(
        cfg,
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=moe_layers,
        **family,
    )


def _hf_experts(config: DecoderConfig, i: int):
    p, n = f"model.layers.{i}.mlp", range(config.num_experts)
    stacks = ([f"{p}.experts.{e}.{x}_proj.weight" for e in n] for x in ("gate", "up", "down"))
    return (f"{p}.gate.weight", *stacks)


def _hf_shared(config: DecoderConfig, i: int):
    p = f"model.layers.{i}.mlp"
    shared = [f"{p}.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")]
    return (*shared, f"{p}.shared_expert_gate.weight")


QWEN3_MOE_GGUF_CONFIG = {
    **DENSE_DECODER_GGUF_CONFIG,
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}


QWEN2_MOE_GGUF_CONFIG = {
    **QWEN3_MOE_GGUF_CONFIG,
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def qwen3moe_gguf_fixup(cfg: dict[str, Any]) -> None:
    cfg["norm_topk_prob"] = True
    cfg.setdefault("intermediate_size", cfg.get("moe_intermediate_size"))


def qwen2moe_gguf_fixup(cfg: dict[str, Any]) -> None:
    cfg["norm_topk_prob"] = False
    cfg.setdefault("intermediate_size", cfg.get("moe_intermediate_size"))


def _gguf_shared(config: DecoderConfig, i: int):
    b = f"blk.{i}"
    shared = [f"{b}.ffn_{x}_shexp.weight" for x in ("gate", "up", "down")]
    return (*shared, f"{b}.ffn_gate_inp_shexp.weight")


class Qwen3MoeForCausalLM(DecoderLM):
    pass


class Qwen2MoeForCausalLM(DecoderLM):
    pass


ARCHITECTURES = [
    Architecture(
        "Qwen3MoeForCausalLM",
        qwen3_moe_from_hf,
        Qwen3MoeForCausalLM,
        with_moe_layers(dense_decoder_hf_map, _hf_experts),
        gguf_arch="qwen3moe",
        gguf_config_keys=QWEN3_MOE_GGUF_CONFIG,
        gguf_weight_map=with_moe_layers(dense_decoder_gguf_map, gguf_experts),
        gguf_config_fixup=qwen3moe_gguf_fixup,
        config_fields=QWEN3_MOE_FIELDS,
    ),
    Architecture(
        "Qwen2MoeForCausalLM",
        qwen2_moe_from_hf,
        Qwen2MoeForCausalLM,
        with_moe_layers(dense_decoder_hf_map, _hf_experts, _hf_shared),
        gguf_arch="qwen2moe",
        gguf_config_keys=QWEN2_MOE_GGUF_CONFIG,
        gguf_weight_map=with_moe_layers(dense_decoder_gguf_map, gguf_experts, _gguf_shared),
        gguf_config_fixup=qwen2moe_gguf_fixup,
        config_fields=QWEN2_MOE_FIELDS,
    ),
]
