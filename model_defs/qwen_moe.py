"""Qwen3-MoE (`Qwen3MoeForCausalLM`, GGUF `qwen3moe`): Qwen3's attention (per-head q/k
norm) with mixture-of-experts feed-forward layers (moe.py): a softmax router, the top
`num_experts_per_tok` experts per token, their weights renormalised (`norm_topk_prob`).
Layers listed in `mlp_only_layers`, and those off the `decoder_sparse_step` grid, keep a
dense MLP, as in transformers.

GGUF (llama.cpp): the experts as stacked `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`
tensors and the router as `ffn_gate_inp`; every layer is a MoE layer and the router
weights are always renormalised (llama.cpp fixes both for qwen3moe).
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, DecoderConfig
from .decoder import DecoderLM
from .qwen2 import QWEN_FIELDS
from .registry import Architecture
from .weight_map import (
    DENSE_DECODER_GGUF_CONFIG,
    WeightMap,
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


def qwen3_moe_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        raise ConfigError("Qwen3MoeForCausalLM: num_experts is not set")
    layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    moe_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return DecoderConfig.from_hf(
        cfg,
        qk_norm=True,
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=moe_layers,
    )


def _moe_layers(base, experts_of):
    """A dense map whose MoE layers' MLP names are replaced by the router and the stacked
    experts; `experts_of(config, i)` names the layer's (gate..., up..., down...) sources."""

    def weight_map(config: DecoderConfig) -> WeightMap:
        m = base(config)
        for i in config.moe_layers:
            p = f"model.layers.{i}.mlp"
            del m[f"{p}.gate_up_proj.weight"], m[f"{p}.down_proj.weight"]
            router, gate_up, down = experts_of(config, i)
            m[f"{p}.gate.weight"] = [router]
            m[f"{p}.experts.gate_up_proj"] = gate_up
            m[f"{p}.experts.down_proj"] = down
        return m

    return weight_map


def _hf_experts(config: DecoderConfig, i: int):
    p, n = f"model.layers.{i}.mlp", range(config.num_experts)
    gate_up = [f"{p}.experts.{e}.{x}_proj.weight" for x in ("gate", "up") for e in n]
    return f"{p}.gate.weight", gate_up, [f"{p}.experts.{e}.down_proj.weight" for e in n]


def _gguf_experts(config: DecoderConfig, i: int):
    b = f"blk.{i}"
    gate_up = [f"{b}.ffn_gate_exps.weight", f"{b}.ffn_up_exps.weight"]
    return f"{b}.ffn_gate_inp.weight", gate_up, [f"{b}.ffn_down_exps.weight"]


QWEN3_MOE_GGUF_CONFIG = {
    **DENSE_DECODER_GGUF_CONFIG,
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}


def qwen3moe_gguf_fixup(cfg: dict[str, Any]) -> None:
    cfg["norm_topk_prob"] = True
    cfg.setdefault("intermediate_size", cfg.get("moe_intermediate_size"))


class Qwen3MoeForCausalLM(DecoderLM):
    pass


ARCHITECTURES = [
    Architecture(
        "Qwen3MoeForCausalLM",
        qwen3_moe_from_hf,
        Qwen3MoeForCausalLM,
        _moe_layers(dense_decoder_hf_map, _hf_experts),
        gguf_arch="qwen3moe",
        gguf_config_keys=QWEN3_MOE_GGUF_CONFIG,
        gguf_weight_map=_moe_layers(dense_decoder_gguf_map, _gguf_experts),
        gguf_config_fixup=qwen3moe_gguf_fixup,
        config_fields=QWEN3_MOE_FIELDS,
    )
]
