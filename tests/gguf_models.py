"""Writing tiny GGUF files from the tiny HF models, the way llama.cpp's converter lays them out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


# Gemma's four norms per layer, as llama.cpp's converter names them.
GEMMA_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf_name: str, layer_names: dict[str, str] = LAYER_NAMES) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{layer_names[module]}.{kind}"


def gemma_metadata(writer, cfg: dict) -> None:
    """What llama.cpp's converter writes for Gemma 2/3 beyond the dense-decoder keys."""
    writer.add_sliding_window(cfg["sliding_window"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            getattr(writer, f"add_{key}")(cfg[key])
    full = (cfg.get("rope_parameters") or {}).get("full_attention") or {}
    if full.get("rope_type") == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])


def write_gemma_gguf(model_dir: Path, out: Path, arch: str) -> Path:
    """A Gemma 2/3 GGUF as llama.cpp's converter writes it: norms stored as 1 + w."""

    def norm_plus_one(name: str, arr: np.ndarray) -> np.ndarray:
        return arr + 1 if name.endswith("norm.weight") else arr

    return write_gguf(
        model_dir,
        out,
        arch,
        layer_names=GEMMA_LAYER_NAMES,
        tensor_fn=norm_plus_one,
        metadata_fn=gemma_metadata,
    )


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k row permutation for the llama architecture
    (its documented formula: reshape(n_head, 2, rows/n_head/2, ...) then swap axes 1, 2)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def quantized_tensor(arr: np.ndarray, qtype: str):
    """(uint8 blocks, GGML type) of `arr` in block type `qtype`, quantized as llama.cpp does:
    by the `gguf` package's own quantizer where it has one (the legacy types), else by
    tallow's numpy codec (the K-quants, which gguf can only dequantize), else (the lattice
    i-quants, which neither writes) random valid blocks (`quant_blocks.weight_blocks`)."""
    import gguf
    from quant_blocks import weight_blocks

    from tallow.compiler.quant import QUANT_FORMATS

    ggml_type = QUANT_FORMATS[qtype].ggml_type
    try:
        blocks = gguf.quants.quantize(arr, ggml_type)
    except NotImplementedError:
        blocks = weight_blocks(arr.reshape(-1, arr.shape[-1]), qtype)
    return np.ascontiguousarray(blocks, np.uint8), ggml_type


def write_gguf(
    model_dir: Path,
    out: Path,
    arch: str,
    *,
    permute_qk: bool = False,
    extra_tensors: dict[str, np.ndarray] | None = None,
    split_max_tensors: int = 0,
    tensor_types: dict[str, str] | None = None,
    layer_names: dict[str, str] = LAYER_NAMES,
    tensor_fn=None,
    metadata_fn=None,
    skip=None,
) -> Path:
    """A GGUF holding the weights of a tiny HF model folder (float32) and its tokenizer.

    `tensor_types` maps GGUF tensor names to block types (tallow's names: "q5_0", "q4k"):
    those tensors are written quantized (`quantized_tensor`), the others float32."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or params.get("full_attention", params)["rope_theta"]
    writer.add_rope_freq_base(theta)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    # tokenizer: the byte-level BPE of the tiny model, padded to the model's vocab size
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    tokens += [f"[PAD{i}]" for i in range(cfg["vocab_size"] - len(tokens))]
    types = [gguf.TokenType.CONTROL if t.startswith("<") else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_add_bos_token(False)
    if metadata_fn is not None:
        metadata_fn(writer, cfg)
    for name, arr in weights.items():
        if skip is not None and skip(name):
            continue  # written by the caller as extra_tensors (stacked experts)
        arr = np.ascontiguousarray(arr.astype(np.float32))
        if permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            arr = llama_cpp_permute(arr, heads)
        if tensor_fn is not None:
            arr = tensor_fn(name, arr)
        qtype = (tensor_types or {}).get(gguf_name(name, layer_names))
        if qtype is None:
            writer.add_tensor(gguf_name(name, layer_names), arr)
        else:
            blocks, ggml_type = quantized_tensor(arr, qtype)
            writer.add_tensor(gguf_name(name, layer_names), blocks, raw_dtype=ggml_type)
    for name, arr in (extra_tensors or {}).items():
        writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for a llama3 rope scaling: per
    rotated pair, the divisor of its frequency (1 for short wavelengths, `factor` for long
    ones, a smooth blend between), from the published llama3 formula."""
    s = cfg["rope_scaling"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old = s["original_max_position_embeddings"]
    low, high = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


# Phi-3's fused projections, as llama.cpp's converter names them (gate and up in `ffn_up`).
PHI3_LAYER_NAMES = {
    **LAYER_NAMES,
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
}


def write_phi3_gguf(model_dir: Path, out: Path) -> Path:
    """A Phi-3 GGUF as llama.cpp's converter writes it: the rotated dimensions, the
    pretraining context, LongRoPE's cos/sin multiplier in the metadata and its factors as
    `rope_factors_long` / `rope_factors_short` tensors; sliding_window 0 for none."""
    import math

    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    params = cfg.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    extra = {}
    longrope = params.get("rope_type") == "longrope"
    if longrope:
        extra = {
            f"rope_factors_{k}.weight": np.asarray(params[f"{k}_factor"], dtype=np.float32)
            for k in ("long", "short")
        }

    def metadata(writer, cfg: dict) -> None:
        writer.add_rope_dimension_count(int(partial * head_dim))
        original = cfg["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
        if longrope:
            scale = cfg["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original))
            )

    return write_gguf(
        model_dir,
        out,
        "phi3",
        layer_names=PHI3_LAYER_NAMES,
        metadata_fn=metadata,
        extra_tensors=extra,
    )
