"""Qwen2 / Qwen2.5: a Llama-shaped decoder whose q, k and v projections carry biases."""

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

# Qwen windows only with use_sliding_window, from layer max_window_layers on (config.py).
QWEN_FIELDS = COMMON_FIELDS | {"use_sliding_window", "max_window_layers"}


class Qwen2Config(DecoderConfig):
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], **overrides: Any) -> DecoderConfig:
        # Qwen2's config.json does not say so, but its q/k/v projections always have biases.
        return super().from_hf(cfg, attention_bias=True, qk_norm=False, **overrides)


class Qwen2ForCausalLM(DecoderLM):
    pass


ARCHITECTURES = [
    Architecture(
        "Qwen2ForCausalLM",
        Qwen2Config.from_hf,
        Qwen2ForCausalLM,
        dense_decoder_hf_map,
        gguf_arch="qwen2",
        gguf_config_keys=DENSE_DECODER_GGUF_CONFIG,
        gguf_weight_map=dense_decoder_gguf_map,
        config_fields=QWEN_FIELDS,
    )
]
