"""The config shared by dense decoder-only models, read from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe a model we can build."""


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Rope theta and scaling, wherever the writer put them.

    transformers 5 writes `rope_parameters` (theta and scaling together) and may omit the
    top-level `rope_theta`; older files write `rope_theta` and `rope_scaling`. Falling back to
    10000 when theta lives only in `rope_parameters` silently produces wrong text.
    """
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type dicts ({"full_attention": {...}}) appear in some models; take the first.
        first = next(iter(params.values()))
        if isinstance(first, dict):
            params = first
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
        else:
            scaling["rope_type"] = rope_type
    return float(theta), scaling


SUPPORTED_ROPE_TYPES = ("llama3",)


@dataclass
class DecoderConfig:
    """Everything a dense decoder-only transformer needs; architecture files extend or fix it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_window_size: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], **overrides: Any) -> DecoderConfig:
        """Read an HF config.json dict; `overrides` are architecture facts (bias, q/k norm)."""
        required = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ]
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ConfigError(f"config.json lacks required field(s): {', '.join(missing)}")
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
        theta, scaling = _rope_settings(cfg)
        eos = cfg.get("eos_token_id")
        eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else list(eos))
        values: dict[str, Any] = dict(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            context_window_size=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
        )
        values.update(overrides)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported (only silu)")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling["rope_type"]
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"rope scaling type {rope_type!r} is not supported "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
