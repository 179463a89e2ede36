"""benchmarks/gguf_shapes.py: the random-weight stand-ins for real GGUF files.

A tiny qwen2 shape (2 layers, vocabulary 1024) goes through the same writer as the real
shapes; `gguf`'s reader, tallow's GGUF source and tokenizer, and llama.cpp (when
llama-cpp-python is installed) must all accept it, with the tensors the shape implies and,
after llama.cpp's own Q4_K_M requantization, the K-quant mix tallow's recipe predicts.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gguf_shapes  # noqa: E402

TINY = gguf_shapes.Shape(
    "qwen2", 256, 2, 4, 2, 64, 512, 1024, tied=False, qkv_bias=True, rope_theta=1e6, rms_eps=1e-6
)


def byte_vocabulary() -> gguf_shapes.Vocabulary:
    """gpt2's 256 byte symbols after three specials, and two merges ("he", "ll")."""
    from tallow.compiler.gguf_tokenizer import _bytes_to_unicode

    symbols = list(_bytes_to_unicode().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *symbols, "he", "ll"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, types, ["h e", "l l"]


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory) -> Path:
    # SmolLM2's own vocabulary (what the real shapes carry) takes GGUFReader ~5 s to parse
    path = tmp_path_factory.mktemp("shapes") / "tiny.f16.gguf"
    gguf_shapes.write_f16(path, "tiny", TINY, byte_vocabulary())
    return path


def test_tiny_shape_has_the_tensors_and_metadata_of_its_shape(tiny_f16):
    from tallow.compiler.gguf_source import gguf_source
    from tallow.compiler.gguf_tokenizer import tokenizer_from_gguf

    reader = gguf.GGUFReader(tiny_f16)
    got = {
        t.name: (tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name)
        for t in reader.tensors
    }
    # 1 embedding + 2 layers x (2 norms, q/k/v weights and biases, o, gate, up, down) + norm + head
    assert len(got) == 1 + 2 * 12 + 2
    assert got["blk.1.attn_k.weight"] == ((2 * 64, 256), "F16")
    assert got["blk.0.attn_q.bias"] == ((4 * 64,), "F32")
    assert got["blk.0.ffn_down.weight"] == ((256, 512), "F16")
    assert got["output.weight"] == ((1024, 256), "F16")
    norm = reader.get_tensor([t.name for t in reader.tensors].index("blk.0.attn_norm.weight")).data
    assert abs(float(np.mean(norm)) - 1.0) < 0.01  # norm scales near one: finite activations
    src = gguf_source("tiny", tiny_f16)
    cfg = src.config
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (256, 2, 1024)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert cfg["rope_theta"] == pytest.approx(1e6)
    tok = tokenizer_from_gguf(reader).tokenizer
    assert tok.get_vocab_size() == 1024
    ids = tok.encode("hello there").ids
    assert tok.decode(ids) == "hello there"
    assert ids[:2] == [259, 260]  # "he", "ll": the merges apply
    assert reader.get_field("tokenizer.ggml.tokens").contents()[-1] == "[PAD762]"


def test_tiny_shape_quantized_by_llamacpp_is_the_q4_k_m_mix(tiny_f16, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    from tallow.compiler.quant.mixes import find_mix
    from tallow.compiler.quant.registry import get_format

    out = tmp_path / "tiny.q4_k_m.gguf"
    gguf_shapes.quantize(tiny_f16, out)
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type for t in reader.tensors}
    shapes = {t.name: [int(d) for d in reversed(t.shape)] for t in reader.tensors}
    expected = find_mix("Q4_K_M").types(shapes)
    assert {n: types[n] for n in expected} == {
        n: get_format(f).ggml_type for n, f in expected.items()
    }
    hist = Counter(t.name for t in types.values())
    assert hist["Q4_K"] > 0 and hist["Q6_K"] > 0 and set(hist) <= {"Q4_K", "Q6_K", "F32"}
    llm = llama_cpp.Llama(str(out), n_ctx=64, n_threads=1, verbose=False)
    assert llm.n_vocab() == 1024
    # llama.cpp reads the same vocabulary: its tokens are tallow's
    from tallow.compiler.gguf_tokenizer import tokenizer_from_gguf

    ours = tokenizer_from_gguf(reader).tokenizer.encode("hello there").ids
    assert llm.tokenize(b"hello there", add_bos=False) == ours


# heads x head_dim (4 x 128) is not hidden (256), as in Qwen3-4B (32 x 128 against 2560)
QWEN3 = gguf_shapes.Shape(
    "qwen3", 256, 2, 4, 2, 128, 512, 1024, tied=True, qk_norm=True, rope_theta=1e6, rms_eps=1e-6
)


def test_qwen3_shape_carries_q_k_norms_that_tallow_reads(tmp_path):
    from tallow.compiler.gguf_source import gguf_source
    from tallow.model_defs.registry import get_architecture

    path = tmp_path / "q3.f16.gguf"
    gguf_shapes.write_f16(path, "q3", QWEN3, byte_vocabulary())
    reader = gguf.GGUFReader(path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    # per layer: 2 norms, q/k/v/o, q and k norms of one head's width, gate/up/down; tied: no head
    assert len(shapes) == 1 + 2 * 11 + 1 and "output.weight" not in shapes
    assert shapes["blk.1.attn_q_norm.weight"] == shapes["blk.1.attn_k_norm.weight"] == (128,)
    assert shapes["blk.0.attn_q.weight"] == (4 * 128, 256)
    src = gguf_source("q3", path)
    assert src.config["architectures"] == ["Qwen3ForCausalLM"]
    cfg = get_architecture(src.config).config_from_hf(src.config)
    # the head width comes from attention.key_length, not hidden / heads (64)
    assert cfg.qk_norm and cfg.head_dim == 128


def test_ftype_names_and_refusals(tmp_path):
    sys.path.insert(0, str(Path(gguf_shapes.__file__).parent))
    import bench_files

    assert gguf_shapes.file_name("llama-3.1-8b", "Q5_K_M") == "llama-3.1-8b.q5_k_m.gguf"
    assert bench_files.split_ftype("llama-3.1-8b.q5_k_m") == ("llama-3.1-8b", "Q5_K_M")
    assert bench_files.split_ftype("qwen3-4b") == ("qwen3-4b", "Q4_K_M")
    assert bench_files.expand(["qwen3-4b.q5_k_m"]) == ["qwen3-4b.q5_k_m"]
    with pytest.raises(SystemExit, match="unknown --ftype 'Q3_K_S'"):
        gguf_shapes.build("qwen3-4b", tmp_path, ("Q3_K_S",))
    with pytest.raises(SystemExit, match="unknown shape 'nope.q5_k_m'"):
        bench_files.expand(["nope.q5_k_m"])
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_all_leaves_out_the_large_shapes():
    sys.path.insert(0, str(Path(gguf_shapes.__file__).parent))
    import bench_files

    every = bench_files.expand(["all"])
    assert "llama-3.2-1b" in every and not set(gguf_shapes.LARGE) & set(every)
    assert bench_files.expand(["llama-3.1-8b"]) == ["llama-3.1-8b"]
