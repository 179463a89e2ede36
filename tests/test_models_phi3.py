"""Phi-3 family tiny models against transformers (issue 22): fused qkv / gate_up
checkpoints, LongRoPE with partial rotary (Phi-4-mini's shape), GGUF `phi3`."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from gguf_models import write_phi3_gguf
from test_parity import PROMPTS, hf_last_logits, run_parity, runner_for

from tallow.compiler.pipeline import CompileOptions, compile_model
from tallow.model_defs.registry import get_architecture

from tiny_models import CONFIGS, load_hf


@pytest.mark.slow
@pytest.mark.parametrize("name", ["phi3", "phi3_longrope"])
def test_phi3_logits_match_transformers_f32(name, tiny_model_dir, tiny_artifact):
    hf = load_hf(tiny_model_dir(name))
    worst, _, picks = run_parity(runner_for(tiny_artifact(name, "f32")), hf)
    assert worst <= 1e-4, f"{name}: max abs logit error {worst}"
    assert [o for o, _, _ in picks] == [r for _, r, _ in picks]


def test_longrope_changes_the_reference(tiny_model_dir):
    """Without LongRoPE (and with full rotary) the same transformers model answers
    differently: the parity above could not pass by ignoring either."""
    folder = tiny_model_dir("phi3_longrope")
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        dtype="float32",
        attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ).eval()
    diff = np.abs(hf_last_logits(load_hf(folder), PROMPTS[1]) - hf_last_logits(plain, PROMPTS[1]))
    assert diff.max() > 1e-2


@pytest.mark.parametrize(("window", "long"), [(256, True), (4, False), (3, False), (5, True)])
def test_longrope_factors_follow_the_compiled_window(window, long):
    """The compile-time choice: long factors when the compiled context window exceeds
    original_max_position_embeddings (4), short ones otherwise; the table equals
    transformers' own LongRoPE frequencies for a sequence of that length."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = CONFIGS["phi3_longrope"]
    hf_config = transformers.AutoConfig.for_model(
        "phi3", **{k: v for k, v in raw.items() if k != "model_type"}
    )
    ref_freq, ref_attention = ROPE_INIT_FUNCTIONS["longrope"](hf_config, seq_len=window)
    config = get_architecture(raw).config_from_hf(dict(raw))
    config.context_window_size = window  # what --context-window does
    table = config.rope_table()
    np.testing.assert_allclose(table.inv_freq, ref_freq.numpy(), rtol=1e-6)  # pow: 1 ulp
    assert table.attention_factor == pytest.approx(ref_attention, rel=1e-12)
    factors = raw["rope_scaling"]["long_factor" if long else "short_factor"]
    assert table.inv_freq[-1] == pytest.approx(1 / (factors[-1] * 10000.0 ** (10 / 12)), rel=1e-6)


@pytest.mark.slow
def test_phi3_gguf_matches_transformers(tiny_model_dir, tmp_path):
    """A GGUF laid out as llama.cpp writes Phi-3 (fused attn_qkv, gate and up in ffn_up,
    LongRoPE factors as tensors, rotated dimensions and multiplier in the metadata) gives
    transformers' logits on the safetensors original."""
    folder = tiny_model_dir("phi3_longrope")
    gguf_path = write_phi3_gguf(folder, tmp_path / "phi3.gguf")
    artifact = compile_model(
        CompileOptions(model=str(gguf_path), output=tmp_path / "art", quiet=True)
    )
    worst, _, picks = run_parity(runner_for(artifact), load_hf(folder))
    assert worst <= 1e-4, f"phi3 GGUF: max abs logit error {worst}"
    assert [o for o, _, _ in picks] == [r for _, r, _ in picks]
