"""Mixtral (`MixtralForCausalLM`; GGUF `llama` with experts): Mistral's attention with a
mixture-of-experts feed-forward on every layer (moe.py): `num_local_experts` experts of
width `intermediate_size`, `num_experts_per_tok` per token, router weights renormalised.

HF checkpoints name the experts `block_sparse_moe.experts.E.w1` (gate), `w3` (up) and `w2`
(down); llama.cpp writes Mixtral as a `llama` GGUF with an expert count and stacked
`ffn_*_exps` tensors (llama.py's GGUF reader hands such a file to this family).
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, DecoderConfig
from .config_fields import COMMON_FIELDS
from .decoder import DecoderLM
from .moe import gguf_experts, with_moe_layers
from .registry import Architecture
from .weight_map import dense_decoder_gguf_map, dense_decoder_hf_map

MIXTRAL_FIELDS = COMMON_FIELDS | {
    "num_local_experts",
    "num_experts_per_tok",
    "router_aux_loss_coef",  # training loss only
    "output_router_logits",  # training output only
    "router_jitter_noise",  # noise on the router in training only
}


def mixtral_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    experts = int(cfg.get("num_local_experts") or 0)
    if not experts:
        raise ConfigError("MixtralForCausalLM: num_local_experts is not set")
    return DecoderConfig.from_hf(
        cfg,
        qk_norm=False,
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=True,
        moe_layers=list(range(int(cfg["num_hidden_layers"]))),
    )


def _hf_experts(config: DecoderConfig, i: int):
    p, n = f"model.layers.{i}.block_sparse_moe", range(config.num_experts)
    stacks = ([f"{p}.experts.{e}.{w}.weight" for e in n] for w in ("w1", "w3", "w2"))
    return (f"{p}.gate.weight", *stacks)


class MixtralForCausalLM(DecoderLM):
    pass


ARCHITECTURES = [
    Architecture(
        "MixtralForCausalLM",
        mixtral_from_hf,
        MixtralForCausalLM,
        with_moe_layers(dense_decoder_hf_map, _hf_experts),
        gguf_weight_map=with_moe_layers(dense_decoder_gguf_map, gguf_experts),
        gguf_permute_qk=True,
        config_fields=MIXTRAL_FIELDS,
    )
]
