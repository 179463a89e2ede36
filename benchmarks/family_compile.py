"""Compile time of each model family at a real configuration's shape (no weights).

    .venv/bin/python benchmarks/family_compile.py [--family gemma3-1b ...] [--target cpu]

Each family is built from its published config.json values (below, as released on the Hub),
exported, lowered and built for the target by `compile_shape.compile_shape`, the same steps
`tallow compile` takes minus reading and writing weights, which do not depend on the family.
Prints one row per family: export, lower, build and total seconds and the peak memory of the
process so far. Families run one after the other in one process: `peak_rss_gib` only grows.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from compile_shape import compile_shape

GELU = "gelu_pytorch_tanh"
FAMILIES = {
    # google/gemma-3-1b-it: 5 local layers (window 512) per global one, q/k norms.
    "gemma3-1b": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152,
        intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        query_pre_attn_scalar=256, hidden_activation=GELU, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=True,
    ),
    # google/gemma-2-2b: alternating window 4096 / global, attention and final soft-capping.
    "gemma2-2b": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=2304,
        intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, sliding_window=4096,
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        rope_theta=10000.0, hidden_activation=GELU, rms_norm_eps=1e-6,
        max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    # microsoft/Phi-3-mini-4k-instruct: fused qkv and gate_up.
    "phi3-mini-4k": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072,
        intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=4096, original_max_position_embeddings=4096,
        sliding_window=2047, hidden_act="silu", tie_word_embeddings=False,
    ),
    # mistralai/Mistral-7B-v0.1: every layer windowed (4096).
    "mistral-7b-v0.1": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, sliding_window=4096, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=32768, hidden_act="silu",
        tie_word_embeddings=False,
    ),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts, top 2.
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
        rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=32768,
        hidden_act="silu", tie_word_embeddings=False,
    ),
    # Qwen/Qwen1.5-MoE-A2.7B: 60 experts, top 4, a shared expert with its gate.
    "qwen2-moe-a2.7b": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=2048,
        intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=151936, num_experts=60, num_experts_per_tok=4,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        decoder_sparse_step=1, norm_topk_prob=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=8192, hidden_act="silu", tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-30B-A3B: 128 experts, top 8.
    "qwen3-moe-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
        norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960, hidden_act="silu", tie_word_embeddings=False,
    ),
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES))
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--sm", type=int, action="append", dest="sms")
    ap.add_argument("--dtype", default="f32")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    print("| family | export s | lower s | build s | total s | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    for name in args.family or list(FAMILIES):
        with tempfile.TemporaryDirectory() as tmp:
            info = compile_shape(FAMILIES[name], args.target, args.dtype, Path(tmp), args.sms)
        t = info["times"]
        print(
            f"| {name} | {t['export_s']} | {t['lower_s']} | {t['build_s']} | {t['total_s']} "
            f"| {t['peak_rss_gib']} |",
            flush=True,
        )
    print(json.dumps({"load_average_end": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
