"""The config shared by dense decoder-only models, read from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .config_fields import ConfigError, check_fields


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
            # "su" is LongRoPE's earlier name (Phi-3 checkpoints still carry it)
            scaling["rope_type"] = "longrope" if rope_type == "su" else rope_type
    return float(theta), scaling


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """Top level (transformers 4) or inside `rope_parameters` (transformers 5)."""
    params = cfg.get("rope_parameters") or {}
    value = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    return float(value if value is not None else 1.0)


def _complete_longrope(cfg: dict[str, Any], scaling: dict[str, Any]) -> None:
    """LongRoPE reads two more numbers from the top level of older configs: the pretraining
    context and the extension `factor` (max over original, which sets the cos/sin
    multiplier); both are kept in the scaling dict, before `--context-window` shrinks the
    compiled window."""
    if "original_max_position_embeddings" not in scaling:
        original = cfg.get("original_max_position_embeddings")
        if original is None:
            raise ConfigError("rope_scaling longrope: original_max_position_embeddings is not set")
        scaling["original_max_position_embeddings"] = int(original)
    missing = [k for k in ("long_factor", "short_factor") if not scaling.get(k)]
    if missing:
        raise ConfigError(f"rope_scaling longrope: {', '.join(missing)} not set")
    if "factor" not in scaling and cfg.get("max_position_embeddings"):
        original = scaling["original_max_position_embeddings"]
        scaling["factor"] = int(cfg["max_position_embeddings"]) / original


def _layer_types(cfg: dict[str, Any]) -> list[str] | None:
    """Per-layer attention kinds: as written, or every layer windowed where a config names a
    window and no layer kinds (Mistral: `sliding_window` applies to all layers)."""
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return None  # Qwen2/3: the window applies only with use_sliding_window
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        first = int(cfg.get("max_window_layers") or 0)  # Qwen2/3: windowed from this layer on
        layers = range(int(cfg["num_hidden_layers"]))
        return [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in layers]
    if cfg.get("sliding_window"):
        return [SLIDING_ATTENTION] * int(cfg["num_hidden_layers"])
    return None


SUPPORTED_ROPE_TYPES = ("llama3", "linear", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# Our own key (not an HF field): the GGUF reader puts a `rope_freqs` tensor's values here.
ROPE_FREQ_FACTORS_KEY = "tallow_rope_freq_factors"


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
    # The parts a family chooses (defaults: Llama). RMSNorm scales by `norm_weight_offset + w`
    # (Gemma stores w around 0 and computes its norms in float32); "sandwich" adds a norm
    # after attention and after the MLP as well (Gemma 2/3).
    norm_weight_offset: float = 0.0
    norm_placement: str = "pre"
    embed_scale: float = 1.0  # the embedding is multiplied by this (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # attention scale is its -0.5 power (Gemma)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None
    # Per-layer attention: FULL_ATTENTION or SLIDING_ATTENTION (the last `sliding_window`
    # positions, the query's own included, as transformers masks them). None: all full.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None  # sliding layers' RoPE base, where it differs
    # Rotated share of each head (Phi-4-mini: 0.75) and per-dimension frequency divisors
    # (a Llama 3.1+ GGUF's `rope_freqs` tensor); both rotate in the graph (rope.py).
    partial_rotary_factor: float = 1.0
    rope_freq_factors: list[float] | None = None
    # Mixture of experts (moe.py): layers listed in `moe_layers` replace the dense MLP with
    # `num_experts` experts of width `moe_intermediate_size`, `num_experts_per_tok` per token
    # (their router weights renormalised to sum 1 with `norm_topk_prob`).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert, sigmoid-gated
    # Tensor-parallel degree the layers were sharded for (tensor_parallel.py): heads and MLP
    # widths above are one worker's share, and the row-parallel projections all-reduce.
    tensor_parallel: int = 1

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
        check_fields(cfg)
        layer_types = _layer_types(cfg)
        theta, scaling = _rope_settings(cfg)
        if scaling is not None and scaling["rope_type"] == "longrope":
            _complete_longrope(cfg, scaling)
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
            sliding_window=(cfg.get("sliding_window") or None) if layer_types else None,
            layer_types=layer_types,
            partial_rotary_factor=_partial_rotary_factor(cfg),
            rope_freq_factors=cfg.get(ROPE_FREQ_FACTORS_KEY),
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
        if self.hidden_act == "swish":
            self.hidden_act = "silu"
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"hidden_act={self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            if unknown:
                raise ConfigError(f"layer_types: unsupported kind(s) {sorted(unknown)}")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ConfigError("layer_types has sliding layers but sliding_window is not set")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling["rope_type"]
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"rope_scaling / rope_parameters: rope type {rope_type!r} is not supported "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < rotary <= self.head_dim or rotary != int(rotary) or int(rotary) % 2:
            raise ConfigError(
                f"partial_rotary_factor={self.partial_rotary_factor} does not rotate an even "
                f"number of the {self.head_dim} dimensions of a head"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"num_experts={self.num_experts}"
            )
        if self.rope_freq_factors is not None and self.rope_scaling is not None:
            raise ConfigError("rope_freqs together with rope scaling metadata is ambiguous")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != rotary // 2:
            raise ConfigError(
                f"rope_freqs has {len(self.rope_freq_factors)} values for {int(rotary) // 2} "
                "rotated dimension pairs"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def rope_table(self):
        """The rope.RopeTable the graph rotates with, or None where the KV cache's own RoPE
        (default, llama3) or Gemma's per-layer rotation applies."""
        from .rope import RopeTable, inverse_frequencies, longrope_factors

        longrope = (self.rope_scaling or {}).get("rope_type") == "longrope"
        if not (longrope or self.rope_freq_factors or self.rotary_dim != self.head_dim):
            return None
        divisors, attention = self.rope_freq_factors, 1.0
        if longrope:
            divisors, attention = longrope_factors(self.rope_scaling, self.context_window_size)
            if len(divisors) != self.rotary_dim // 2:
                raise ConfigError(
                    f"rope_scaling longrope: {len(divisors)} factors for "
                    f"{self.rotary_dim // 2} rotated dimension pairs"
                )
        inv_freq = inverse_frequencies(self.rope_theta, self.rotary_dim, divisors)
        return RopeTable(inv_freq, attention)

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.num_experts > 0 and layer_id in self.moe_layers

    def layer_window(self, layer_id: int) -> int | None:
        """The layer's attention window in positions, or None for full attention (also when
        the window spans the whole context: then it changes nothing)."""
        if not self.is_sliding_layer(layer_id):
            return None
        if self.sliding_window >= self.context_window_size:
            return None
        return self.sliding_window

    def is_sliding_layer(self, layer_id: int) -> bool:
        """The layer's kind (its RoPE follows it even where its window spans the context)."""
        return self.layer_types is not None and self.layer_types[layer_id] == SLIDING_ATTENTION

    @property
    def windowed(self) -> bool:
        return any(self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    def layer_rope_theta(self, layer_id: int) -> float:
        if self.rope_local_theta is not None and self.is_sliding_layer(layer_id):
            return self.rope_local_theta
        return self.rope_theta

    @property
    def rope_in_graph(self) -> bool:
        """True when layers rotate with different settings (Gemma 3: local and global bases,
        linear scaling on global layers only): the graph applies RoPE itself, since the KV
        cache applies one setting to every layer."""
        local = self.rope_local_theta is not None and self.rope_local_theta != self.rope_theta
        linear = (self.rope_scaling or {}).get("rope_type") == "linear"
        return local or linear or self.rope_table() is not None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
