"""Llama family: SmolLM2, Llama 2/3/3.1 (llama3 rope scaling) and Mistral-style dense models."""

from __future__ import annotations

from typing import Any

from .config import DecoderConfig
from .config_fields import COMMON_FIELDS
from .decoder import DecoderLM
from .registry import Architecture
from .weight_map import (
    DENSE_DECODER_GGUF_CONFIG,
    dense_decoder_gguf_map,
    dense_decoder_hf_map,
)

# mlp_bias is read in order to be refused when set (config_fields.REFUSED).
LLAMA_FIELDS = COMMON_FIELDS | {"mlp_bias", "pretraining_tp"}


class LlamaConfig(DecoderConfig):
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], **overrides: Any) -> DecoderConfig:
        # Llama checkpoints may carry q/k/v biases (attention_bias); no per-head q/k norm.
        # transformers' Llama has no window: a stray `sliding_window` means nothing to it.
        cfg = {k: v for k, v in cfg.items() if k not in ("sliding_window", "layer_types")}
        return super().from_hf(cfg, qk_norm=False, **overrides)


def mistral_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    """Mistral: `sliding_window` windows every layer (config.py); the CPU kernels apply it."""
    return DecoderConfig.from_hf(cfg, qk_norm=False)


class LlamaForCausalLM(DecoderLM):
    pass


# llama.cpp writes Mixtral as a `llama` GGUF that counts experts.
LLAMA_GGUF_CONFIG = {
    **DENSE_DECODER_GGUF_CONFIG,
    "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
}


def llama_gguf_fixup(cfg: dict[str, Any]) -> None:
    """A `llama` GGUF with experts is a Mixtral (mixtral.py)."""
    if cfg.get("num_local_experts"):
        cfg["architectures"] = ["MixtralForCausalLM"]


ARCHITECTURES = [
    Architecture(
        "LlamaForCausalLM",
        LlamaConfig.from_hf,
        LlamaForCausalLM,
        dense_decoder_hf_map,
        gguf_arch="llama",
        gguf_config_keys=LLAMA_GGUF_CONFIG,
        gguf_weight_map=dense_decoder_gguf_map,
        gguf_permute_qk=True,
        gguf_config_fixup=llama_gguf_fixup,
        config_fields=LLAMA_FIELDS,
    ),
    Architecture("MistralForCausalLM", mistral_from_hf, LlamaForCausalLM, dense_decoder_hf_map),
]
