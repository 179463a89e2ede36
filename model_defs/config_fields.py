"""Which config.json fields change the math, and what tallow does with each.

Every field of a family's transformers config class is either read by the family's config
reader (`Architecture.config_fields`), harmless at inference (`HARMLESS`), or refused when
set to anything but its neutral value (`REFUSED`): a checkpoint whose config asks for math
tallow does not implement fails at compile time naming the field, instead of compiling into
a model that silently computes something else. tests/test_config_fields.py walks the
transformers classes against these tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe a model we can build."""


# Read by every family's reader (DecoderConfig.from_hf).
COMMON_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "rope_parameters",  # theta and scaling type (unsupported types refused)
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "bos_token_id",
        "eos_token_id",
        "sliding_window",
        "layer_types",
    }
)

# No effect on inference outputs: training-only settings, padding, caching switches;
# `pretraining_tp` only splits Llama's matmuls into slices with the same result.
HARMLESS = frozenset(
    {
        "initializer_range",
        "use_cache",
        "pad_token_id",
        "attention_dropout",
        "pretraining_tp",
        "resid_pdrop",  # dropouts: training only (Phi-3)
        "embd_pdrop",
    }
)


def _falsy(value: Any) -> bool:
    return not value


# field -> (accepted value?, what is not implemented)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "mlp_bias": (_falsy, "biases on the MLP projections are not implemented"),
    "use_bidirectional_attention": (_falsy, "bidirectional attention is not implemented"),
}


def check_fields(cfg: dict[str, Any]) -> None:
    """Raise ConfigError naming every field set to math tallow does not implement."""
    problems = [
        f"{name}={cfg[name]!r}: {why}"
        for name, (accepted, why) in REFUSED.items()
        if name in cfg and not accepted(cfg[name])
    ]
    if problems:
        raise ConfigError("; ".join(problems))
