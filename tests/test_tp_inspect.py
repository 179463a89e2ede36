"""`tallow inspect --tensor-parallel N [--gpu NAME]` (runtime/tp_estimate.py) on a Qwen3-8B
shape (hidden 4096, 36 layers, 32/8 heads of 128, FFN 12288, vocab 151936, bf16), the shape
issue 38 asks about, against arithmetic done here by hand from those numbers. The manifest
is the tiny Qwen3's with the 8B's config and parameter shapes written in: inspect reads the
manifest only, no weights."""

from __future__ import annotations

import dataclasses

import pytest

from tallow.runtime.manifest import KVCacheInfo, Manifest, ParamInfo

H, FFN, LAYERS, HEADS, KV_HEADS, D, VOCAB = 4096, 12288, 36, 32, 8, 128, 151936
BF16 = 2


def _qwen3_8b_params() -> list[ParamInfo]:
    def p(name, *shape):
        return ParamInfo(name, list(shape), "bfloat16", "params_00000.safetensors")

    params = [p("model.embed_tokens.weight", VOCAB, H)]
    for i in range(LAYERS):
        x = f"model.layers.{i}"
        params += [
            p(f"{x}.input_layernorm.weight", H),
            p(f"{x}.self_attn.qkv_proj.weight", (HEADS + 2 * KV_HEADS) * D, H),
            p(f"{x}.self_attn.o_proj.weight", H, HEADS * D),
            p(f"{x}.self_attn.q_norm.weight", D),
            p(f"{x}.self_attn.k_norm.weight", D),
            p(f"{x}.post_attention_layernorm.weight", H),
            p(f"{x}.mlp.gate_up_proj.weight", 2 * FFN, H),
            p(f"{x}.mlp.down_proj.weight", H, FFN),
        ]
    return [*params, p("model.norm.weight", H), p("lm_head.weight", VOCAB, H)]


@pytest.fixture
def qwen3_8b(tiny_artifact, tmp_path):
    m = Manifest.read(tiny_artifact("qwen3"))
    config = {
        **m.model.config,
        "vocab_size": VOCAB,
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": D,
        "tie_word_embeddings": False,
    }
    kv = KVCacheInfo(16, "bfloat16", 40960, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=D)
    m = dataclasses.replace(
        m,
        model=dataclasses.replace(m.model, config=config),
        dtype="bfloat16",
        quantization="bf16",
        kv_cache=kv,
        params=_qwen3_8b_params(),
    )
    m.write(tmp_path)
    return tmp_path


def _by_hand(n: int, batch: int, context: int, prefill: int) -> dict:
    allreduces = 2 * LAYERS  # after o_proj and after down_proj, every layer
    per_token = H * BF16
    # a decode step on one GPU reads every weight but the embedding table, B of its rows,
    # and every sequence's K and V
    attn = (HEADS + 2 * KV_HEADS) * D * H + H * HEADS * D
    mlp = 3 * H * FFN
    norms = 2 * H + 2 * D
    split = LAYERS * (attn + mlp) * BF16
    replicated = (LAYERS * norms + H + VOCAB * H) * BF16 + batch * H * BF16
    kv = batch * context * LAYERS * 2 * KV_HEADS * D * BF16
    one = split + replicated + kv
    worker = split / n + replicated + kv / n
    ring = 2 * (n - 1) / n * allreduces * batch * per_token
    ar = ring / 450e9  # H200 NVLink: 900 GB/s both ways
    return {
        "allreduces": allreduces,
        "per_token": per_token,
        "decode": allreduces * batch * per_token,
        "prefill": allreduces * prefill * per_token,
        "one_ms": one / 4.8e12 * 1e3,
        "worker_ms": worker / 4.8e12 * 1e3,
        "ar_ms": ar * 1e3,
        "speedup": one / (worker + ar * 4.8e12),
    }


@pytest.mark.parametrize(("n", "batch"), [(2, 1), (4, 8)])
def test_inspect_gpu_h200_tensor_parallel_on_a_qwen3_8b_shape(qwen3_8b, capsys, n, batch):
    from tallow.cli.main import main

    args = ["inspect", str(qwen3_8b), "--gpu", "H200", "--tensor-parallel", str(n)]
    assert main([*args, "--batch", str(batch), "--prefill", "1024"]) == 0
    out = capsys.readouterr().out
    want = _by_hand(n, batch, context=512, prefill=1024)
    assert "an estimate on paper" in out
    assert "all-reduces per layer: 2 " in out
    assert f"all-reduces per step:  {want['allreduces']} (36 layers)" in out
    assert f"bytes per all-reduce per token: {want['per_token']:,} (hidden 4096 x bfloat16)" in out
    assert f"decode, batch {batch}: {want['decode']:,} bytes all-reduced per step" in out
    assert f"prefill of 1024 tokens: {want['prefill']:,} bytes" in out
    assert f"{want['ar_ms']:.4f} ms per step" in out
    assert f"{want['one_ms']:.3f} ms on 1 GPU" in out
    assert f"{want['worker_ms']:.3f} ms on each of {n}" in out
    assert f"decode speed-up bound: {want['speedup']:.2f}x" in out
    print(out)


def test_inspect_tensor_parallel_without_a_gpu_prints_the_traffic(qwen3_8b, capsys):
    from tallow.cli.main import main

    assert main(["inspect", str(qwen3_8b), "--tensor-parallel", "2"]) == 0
    out = capsys.readouterr().out
    # 72 all-reduces of 8 KiB per token: 576 KiB per decode step of one sequence
    assert "589,824 bytes all-reduced per step (576.0 KiB)" in out
    assert "on H200" not in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tensor-parallel", "3"], "--tensor-parallel 3: must be a power of two"),
        (["--tensor-parallel", "16"], "--tensor-parallel 16: does not divide the 8 KV heads"),
        (["--tensor-parallel", "2", "--gpu", "M2 Max"], "M2 Max: one GPU per machine"),
    ],
)
def test_inspect_refuses_what_cannot_be_split_in_one_line(qwen3_8b, capsys, args, says):
    from tallow.cli.main import main

    assert main(["inspect", str(qwen3_8b), *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
