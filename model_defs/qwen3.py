"""Qwen3 dense: per-head RMSNorm on q and k before rotary, explicit head_dim, no qkv bias."""

from __future__ import annotations

from typing import Any

from .config import DecoderConfig
from .decoder import DecoderLM
from .qwen2 import QWEN_FIELDS
from .registry import Architecture
from .weight_map import (
    DENSE_DECODER_GGUF_CONFIG,
    dense_decoder_gguf_map,
    dense_decoder_hf_map,
)


class Qwen3Config(DecoderConfig):
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], **overrides: Any) -> DecoderConfig:
        return super().from_hf(cfg, qk_norm=True, **overrides)


class Qwen3ForCausalLM(DecoderLM):
    pass


ARCHITECTURES = [
    Architecture(
        "Qwen3ForCausalLM",
        Qwen3Config.from_hf,
        Qwen3ForCausalLM,
        dense_decoder_hf_map,
        gguf_arch="qwen3",
        gguf_config_keys=DENSE_DECODER_GGUF_CONFIG,
        gguf_weight_map=dense_decoder_gguf_map,
        config_fields=QWEN_FIELDS,
    )
]
