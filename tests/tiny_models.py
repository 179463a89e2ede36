"""Tiny random-weight Hugging Face models that the tests create (no hub access needed)."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = (
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog. "
    "Héllo wörld, ça va? 東京は日本の首都です。 def f(x):\n    return x * 2\n"
    "Numbers 0123456789 and symbols !@#$%^&*() are tokens too. "
) * 20

BASE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}

# One entry per feature the issue names: GQA, tied/untied, qkv bias, q/k norm,
# llama3 rope scaling, head_dim != hidden/heads.
CONFIGS = {
    "llama": {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    # GGUF has no llama3 rope-scaling fields (llama.cpp stores a rope_freqs tensor instead;
    # test_gguf writes one from this model).
    "llama_plain": {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        "rope_theta": 100000.0,
    },
    "qwen2": {
        **BASE,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
    },
    # Rows of 256 weights (hidden 256, FFN 512): room for K-quant blocks in every matrix.
    "qwen2_wide": {
        **BASE,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 256,
        "intermediate_size": 512,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
    },
    # Qwen3 with rows of 256 weights: every matrix takes K-quant blocks (GPU schedule checks).
    "qwen3_wide": {
        **BASE,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 256,
        "intermediate_size": 512,
        "head_dim": 64,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
    },
    "qwen3": {
        **BASE,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "tie_word_embeddings": False,
        "head_dim": 32,
        "num_key_value_heads": 1,
        "rope_theta": 1000000.0,
    },
    # Gemma 2/3 with windows of 8 positions (the parity prompts run past them), both layer
    # kinds, a query_pre_attn_scalar that differs from head_dim, small soft caps that bite.
    "gemma2": {
        **BASE,
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "num_hidden_layers": 3,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 10.0,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        **BASE,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": True,
    },
    # What a GGUF can say (llama.cpp fixes the rest per architecture): Gemma 2 alternates
    # windowed and global layers, Gemma 3 makes every 6th global; the attention scale is
    # head_dim's; Gemma 3's windowed layers rotate with base 10k.
    "gemma2_gguf": {
        **BASE,
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "num_hidden_layers": 2,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 32,
        "sliding_window": 8,
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 10.0,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "gemma3_gguf": {
        **BASE,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 32,
        "sliding_window": 8,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": True,
    },
    # Phi-3: fused qkv and gate_up in the checkpoint, default RoPE.
    "phi3": {
        **BASE,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "pad_token_id": 0,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    # Phi-4-mini's shape of RoPE: 3/4 of each head rotates, LongRoPE with factors that
    # differ per dimension; the pretraining context (4) is below every parity sequence, so
    # transformers rotates with the long factors throughout, as the compiled model does
    # (its 256-position window exceeds 4); the cos/sin multiplier is sqrt(1 + ln 64 / ln 4).
    "phi3_longrope": {
        **BASE,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "pad_token_id": 0,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 4,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 20.0],
            "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5],
        },
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    # Qwen3-MoE: 8 experts, 2 per token (renormalised); layer 1 is a dense MLP
    # (mlp_only_layers), so both layer kinds are exercised.
    "qwen3_moe": {
        **BASE,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": 3,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    # Qwen2-MoE: q/k/v biases, router weights not renormalised, a shared expert with its
    # sigmoid gate on every MoE layer; layer 1 off the decoder_sparse_step grid stays dense.
    "qwen2_moe": {
        **BASE,
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "num_hidden_layers": 2,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    # Mixtral: every layer MoE, 4 experts of width intermediate_size, 2 per token.
    "mixtral": {
        **BASE,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    # Rows of 256 weights in every expert matrix (hidden 256, expert width 256): room for
    # K-quant blocks in the stacked experts; one layer, all MoE, as llama.cpp writes
    # qwen2moe/qwen3moe (the GGUF quantized-expert tests).
    "qwen3_moe_wide": {
        **BASE,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "norm_topk_prob": True,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen2_moe_wide": {
        **BASE,
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "norm_topk_prob": False,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "mixtral_wide": {
        **BASE,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    # 8 q heads of 64 (o_proj: 512 inputs) and FFN 512: at TP=2 each worker's share of
    # o_proj and down_proj is whole 256-weight K-quant blocks.
    "qwen3_heads8": {
        **BASE,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
    },
    # Mistral's window covers every layer.
    "mistral_window": {
        **BASE,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 8,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}
# Tensor parallelism at 4 workers needs 4 KV heads: the same models with one KV head per q
# head (test_tp_families.py, test_tp_moe.py).
CONFIGS["qwen3_moe_kv4"] = {**CONFIGS["qwen3_moe"], "num_key_value_heads": 4}
CONFIGS["mistral_kv4"] = {**CONFIGS["mistral_window"], "num_key_value_heads": 4}


def make_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 8,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": (
                    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n"
                    "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
                ),
            }
        )
    )


def make_model(folder: Path, name: str, seed: int = 0, sharded: bool = False) -> Path:
    """Write config.json, safetensors weights and a tokenizer for CONFIGS[name]."""
    import torch
    import transformers

    cfg = dict(CONFIGS[name])
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = transformers.AutoConfig.for_model(
        cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger weights make logit differences visible
            p.normal_(0, 0.2)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, max_shard_size="100KB" if sharded else "1GB")
    make_tokenizer(folder, cfg["vocab_size"])
    return folder


def load_hf(folder: Path):
    import transformers

    # eager attention: the reference implementation (soft caps and windows included)
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype="float32", attn_implementation="eager"
    ).eval()
