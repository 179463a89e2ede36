"""Every config field of each family either reaches the math or is refused (issue 22).

The walk: each field a family's transformers config class declares is read by our reader
(`Architecture.config_fields`), listed as harmless at inference, or refused when set
(`config_fields.REFUSED`). A field transformers adds later fails this test until someone
decides which it is. Then: a math-changing field set to something tallow does not
implement is refused at compile time, naming the field.
"""

from __future__ import annotations

import pytest
import transformers

from tallow.model_defs.config import ConfigError
from tallow.model_defs.config_fields import HARMLESS, REFUSED
from tallow.model_defs.registry import get_architecture

from tiny_models import CONFIGS

# Our architecture name -> (transformers config class, a tiny config of that family).
FAMILIES = {
    "LlamaForCausalLM": ("LlamaConfig", "llama_plain"),
    "MistralForCausalLM": ("MistralConfig", "mistral_window"),
    "Qwen2ForCausalLM": ("Qwen2Config", "qwen2"),
    "Qwen3ForCausalLM": ("Qwen3Config", "qwen3"),
    "Gemma2ForCausalLM": ("Gemma2Config", "gemma2"),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", "gemma3"),
    "Phi3ForCausalLM": ("Phi3Config", "phi3"),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "qwen3_moe"),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", "qwen2_moe"),
    "MixtralForCausalLM": ("MixtralConfig", "mixtral"),
}


def declared_fields(cls) -> set[str]:
    """The fields a transformers config class declares beyond PreTrainedConfig's own."""
    fields: set[str] = set()
    for klass in cls.__mro__:
        if klass is transformers.PreTrainedConfig:
            break
        fields |= set(getattr(klass, "__annotations__", {}))
    return fields


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_field_is_handled_harmless_or_refused(arch):
    cls_name, tiny = FAMILIES[arch]
    family = get_architecture({"architectures": [arch]})
    known = family.config_fields | HARMLESS | set(REFUSED)
    unknown = sorted(declared_fields(getattr(transformers, cls_name)) - known)
    assert not unknown, f"{arch}: fields neither handled, harmless nor refused: {unknown}"


def read(arch: str, cfg: dict):
    return get_architecture({"architectures": [arch]}).config_from_hf(cfg)


# (family, tiny config, field, a value whose math tallow does not implement)
REFUSALS = [
    ("LlamaForCausalLM", "llama_plain", "mlp_bias", True),
    ("Gemma3ForCausalLM", "gemma3", "use_bidirectional_attention", True),
    ("LlamaForCausalLM", "llama_plain", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    ("LlamaForCausalLM", "llama_plain", "rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
    ("Qwen2ForCausalLM", "qwen2", "rope_scaling", {"type": "longrope", "factor": 2.0}),
    ("LlamaForCausalLM", "llama_plain", "hidden_act", "relu2"),
    ("Gemma2ForCausalLM", "gemma2", "hidden_activation", "gelu"),
    ("Gemma2ForCausalLM", "gemma2", "layer_types", ["chunked_attention"] * 3),
]


@pytest.mark.parametrize(("arch", "tiny", "field", "value"), REFUSALS)
def test_unimplemented_math_is_refused_naming_the_field(arch, tiny, field, value):
    cfg = {**CONFIGS[tiny], field: value}
    read(arch, CONFIGS[tiny])  # the tiny config itself is fine
    with pytest.raises(ConfigError) as err:
        read(arch, cfg)
    named = "rope" if field == "rope_scaling" else field.replace("hidden_activation", "hidden_act")
    assert named in str(err.value)


def test_rope_parameters_scaling_is_refused_too():
    """transformers 5 writes the scaling type inside rope_parameters."""
    cfg = {**CONFIGS["llama_plain"]}
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ConfigError, match="rope_parameters"):
        read("LlamaForCausalLM", cfg)


def test_windows_are_read_per_family():
    # Mistral: every layer; Qwen2: only with use_sliding_window, from max_window_layers on
    mistral = read("MistralForCausalLM", CONFIGS["mistral_window"])
    assert [mistral.layer_window(i) for i in range(2)] == [8, 8]
    llama = read("LlamaForCausalLM", {**CONFIGS["llama_plain"], "sliding_window": 8})
    assert not llama.windowed  # transformers' Llama ignores the field
    qwen = {**CONFIGS["qwen2"], "sliding_window": 8, "use_sliding_window": False}
    assert read("Qwen2ForCausalLM", qwen).layer_window(0) is None
    qwen.update(use_sliding_window=True, max_window_layers=1)
    assert [read("Qwen2ForCausalLM", qwen).layer_window(i) for i in range(2)] == [None, 8]
    gemma3 = read("Gemma3ForCausalLM", {**CONFIGS["gemma3"], "layer_types": None})
    # no layer_types: every 6th layer global (transformers' sliding_window_pattern default)
    assert [gemma3.layer_window(i) for i in range(3)] == [8, 8, 8]
    assert gemma3.rope_local_theta == 10000.0 and gemma3.rope_theta == 1000000.0


def test_gemma3_multimodal_checkpoint_reads_its_text_tower():
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {k: v for k, v in CONFIGS["gemma3"].items() if k != "architectures"},
        "vision_config": {"hidden_size": 1152},
    }
    family = get_architecture(cfg)
    config = family.config_from_hf(cfg)
    assert config.hidden_size == CONFIGS["gemma3"]["hidden_size"]
    names = family.hf_weight_map(config)["model.layers.0.self_attn.qkv_proj.weight"]
    assert names[0] == "language_model.model.layers.0.self_attn.q_proj.weight"


def test_windows_and_soft_caps_are_refused_off_the_cpu():
    from tvm.target import Target

    config = read("Gemma2ForCausalLM", CONFIGS["gemma2"])
    family = get_architecture({"architectures": ["Gemma2ForCausalLM"]})
    with pytest.raises(ConfigError, match="sliding_window=8.*attn_logit_softcapping"):
        family.build(config, "float16", Target({"kind": "cuda", "arch": "sm_90"}))


def test_gemma3_rope_base_follows_the_layer_kind_not_its_window():
    """--context-window below the window makes windows moot, but a local layer still
    rotates with the local base."""
    config = read("Gemma3ForCausalLM", CONFIGS["gemma3"])
    config.context_window_size = 8  # the window (8) spans the whole context
    assert config.layer_window(0) is None and not config.windowed
    assert config.layer_rope_theta(0) == 10000.0 and config.layer_rope_theta(1) == 1000000.0
