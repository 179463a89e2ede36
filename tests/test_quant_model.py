"""Quantized weights in whole models: GGUF types kept as they are, and `--quant` on floats."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from float_prefill import float_prefill_levels

from tallow.cli.generate import encode_prompt
from tallow.cli.main import main
from tallow.compiler.pipeline import CompileOptions, compile_model
from tallow.compiler.quant import QUANT_FORMATS, quantize
from tallow.runtime.generate import generate_tokens
from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner, all_position_logits
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.served_model import ServedModel

from conftest_gguf import smollm2_gguf  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


PROMPTS = [[5, 17, 40, 3, 99, 250, 7], [11, 12, 13, 200, 201, 66, 8, 9, 10, 120, 44]]


def logits_of(artifact) -> np.ndarray:
    runner = TVMModelRunner(artifact, kv=KVCacheConfig(4, 512, 64))
    for i in range(len(PROMPTS)):
        runner.add_sequence(i)
    return runner.forward([(i, p) for i, p in enumerate(PROMPTS)])


def manifest_of(artifact) -> dict:
    return yaml.safe_load((artifact / "manifest.yaml").read_text())


def stored_types(manifest: dict, src) -> dict[str, str]:
    """{source tensor: the type the artifact stores it in}, read from the manifest. A fused
    weight split into runs of one type (`P.runs.{i}.weight`) gives each run's type to the
    parts whose rows it holds."""
    import json

    from safetensors import safe_open

    from tallow.model_defs.registry import get_architecture
    from tallow.model_defs.weight_map import run_param

    cfg = json.loads((src / "config.json").read_text())
    arch = get_architecture(cfg)
    stored = {p["name"]: p for p in manifest["params"]}
    with safe_open(src / "model.safetensors", "np") as f:
        rows = {n: f.get_slice(n).get_shape()[0] for n in f.keys()}  # noqa: SIM118
    out = {}
    for param, parts in arch.hf_weight_map(arch.config_from_hf(cfg)).items():
        if param in stored:
            out.update((s, stored[param]["quant"]) for s in parts)
            continue
        left, i = list(parts), 0
        while left:
            run, held = stored[run_param(param, i)], 0
            while held < run["shape"][0]:
                out[left[0]] = run["quant"]
                held += rows[left.pop(0)]
            i += 1
    return out


def dequantized_twin(src, dst, types: dict[str, str]):
    """A copy of an HF model folder whose weights are what the quantized artifact holds:
    each tensor quantized to its type in `types` (`stored_types`), decoded by gguf's own
    dequantizer."""
    import shutil

    import gguf
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    for name, w in weights.items():
        qtype = types.get(name, "none")
        if qtype != "none":
            blocks = quantize(w.astype(np.float32), qtype)
            weights[name] = gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type)
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def assert_types_are_the_mix(stored: dict[str, str], src, mix: str) -> None:
    """Each source tensor is stored in the type the mix gives it (the mixes are checked
    against llama.cpp in test_quant_mixes)."""
    from gguf_models import gguf_name
    from safetensors import safe_open

    from tallow.compiler.quant.mixes import MIXES

    with safe_open(src / "model.safetensors", "np") as f:
        shapes = {gguf_name(n): f.get_slice(n).get_shape() for n in f.keys()}  # noqa: SIM118
    want = MIXES[mix].types(shapes)
    assert stored == {n: want.get(gguf_name(n), "none") for n in stored}


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q4k"])
def test_quant_on_float_model(quant, tiny_model_dir, tmp_path):
    """qwen2 (q/k/v bias on a quantized matmul) quantized with --quant equals, to float32
    rounding, the float model built from the same weights decoded by gguf's dequantizer.
    Its rows (64, 128) are not multiples of 256: q4k falls back to q5_0, q6k to q8_0, as
    llama.cpp does; q4k is the mix q4k_m (its head, last attn_v and ffn_down in q6k)."""
    src = tiny_model_dir("qwen2")
    art = compile_model(
        CompileOptions(
            model=str(src), quant=quant, output=tmp_path, quiet=True, cpu=float_prefill_levels()
        )
    )
    m = manifest_of(art)
    mix = {"q4k": "q4k_m"}.get(quant, quant)
    assert m["quantization"] == mix and mix in art.name
    stored = stored_types(m, src)
    assert_types_are_the_mix(stored, src, mix)
    types = {p["name"]: p["quant"] for p in m["params"]}
    assert types["lm_head.weight"] == "q8_0"  # the head: q6k, its fallback at 64 columns
    assert types["model.layers.1.mlp.down_proj.weight"] == ("q8_0" if mix == "q4k_m" else mix)
    if mix == "q4k_m":  # layer 1's attn_v q6k -> q8_0 beside q/k q5_0: two runs, quantized
        qkv = "model.layers.1.self_attn.qkv_proj"
        assert (types[f"{qkv}.runs.0.weight"], types[f"{qkv}.runs.1.weight"]) == ("q5_0", "q8_0")
    expected = {"q8_0": "q8_0", "q4_0": "q4_0", "q4k": "q5_0"}[quant]
    assert types["model.layers.0.self_attn.qkv_proj.weight"] == expected
    assert types["model.layers.0.self_attn.qkv_proj.bias"] == "none"
    assert types["model.layers.0.input_layernorm.weight"] == "none"
    twin = dequantized_twin(src, tmp_path / "twin", stored)
    ref = logits_of(compile_model(CompileOptions(model=str(twin), output=tmp_path, quiet=True)))
    got = logits_of(art)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_quantized_weight_bytes(tiny_model_dir, tmp_path):
    art = compile_model(
        CompileOptions(
            model=str(tiny_model_dir("qwen3")), quant="q4_0", output=tmp_path, quiet=True
        )
    )
    for p in manifest_of(art)["params"]:
        if p["quant"] != "none":
            qt = QUANT_FORMATS[p["quant"]]
            rows, row_bytes = p["shape"]
            cols = row_bytes * qt.block_size // qt.type_size
            assert row_bytes * rows * 8 / (rows * cols) == pytest.approx(qt.bits_per_weight)


def test_unknown_quant_lists_valid(capsys, tiny_model_dir, tmp_path):
    argv = ["compile", "--model", str(tiny_model_dir("qwen3")), "--quant", "q9", "--output"]
    assert main([*argv, str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "unknown --quant 'q9'" in err and "q4k" in err and "q8_0" in err


SMOL_PROMPTS = [
    ("The capital of France is", False),
    ("def fibonacci(n):", False),
    ("What is the capital of France?", True),
]


def test_smollm2_native_types_match_f32(smollm2_gguf, tmp_path_factory):  # noqa: F811
    """The GGUF's own Q4_1/Q8_0 blocks, decoded in the fused kernels, against the same file
    dequantized to f32 at compile time: the same weights, so the same logits at every
    position of a prompt and its continuation (prefill: float activations in both; on x86
    with AVX2 the native artifact is built `x86-64-v2`, `float_prefill_levels`).

    The continuation is the native artifact's greedy decode (where its matmuls round the
    activations to int8, as on arm64 they do not): each of its tokens must be
    the f32 model's choice, or within a near-tie of it (an int8 rounding moves a logit by
    about 0.1; seen: one step of 48 with a 0.14 gap)."""
    native = compile_model(
        CompileOptions(
            model=str(smollm2_gguf),
            output=tmp_path_factory.mktemp("n"),
            quiet=True,
            cpu=float_prefill_levels(),
        )
    )
    f32 = compile_model(
        CompileOptions(
            model=str(smollm2_gguf), quant="f32", output=tmp_path_factory.mktemp("f"), quiet=True
        )
    )
    m = manifest_of(native)
    types = {p["quant"] for p in m["params"]}
    assert {"q4_1", "q8_0", "none"} == types and m["quantization"] == "q4_1"
    weights = sum(
        (native / s).stat().st_size for s in {p["shape"] and p["shard"] for p in m["params"]}
    )
    assert weights < 100 * 2**20  # 135M weights at ~4.5 bits, not 540 MB of f32
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runners = [TVMModelRunner(a, kv=KVCacheConfig(1, 1024, 256)) for a in (native, f32)]
    exact = 0
    for prompt, chat in SMOL_PROMPTS:
        ids = encode_prompt(ServedModel.from_runner(runners[0]), prompt, chat, None)
        tokens = list(generate_tokens(runners[0], ids, params))
        seq = list(ids) + tokens
        got, want = (all_position_logits(r, seq) for r in runners)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), prompt
        steps = want[len(ids) - 1 : len(seq) - 1]
        gaps = steps.max(axis=1) - steps[np.arange(len(tokens)), tokens]
        assert gaps.max() <= 0.5, (prompt, gaps)
        exact += int((gaps == 0).sum())
    assert exact >= 44  # of 48: near-ties are rare


def test_smollm2_q8_0_perplexity_within_1_percent_of_f32(smollm2_gguf, tmp_path_factory):  # noqa: F811
    from pathlib import Path

    from tallow.runtime.evaluate import perplexity

    # The weights' rounding alone: float prefill activations (on x86 with AVX2 the int8
    # prefill adds its own, about 0.13% on this text: docs/models.md)
    text = (Path(__file__).parent / "data" / "prose.txt").read_text()
    ppl = {}
    for fmt in ("f32", "q8_0"):
        art = compile_model(
            CompileOptions(
                model=str(smollm2_gguf),
                quant=fmt,
                output=tmp_path_factory.mktemp(fmt),
                quiet=True,
                allow_requantize=True,  # the shipped file is Q4_1: q8_0 rounds it again
                cpu=float_prefill_levels(),
            )
        )
        runner = TVMModelRunner(art, kv=KVCacheConfig(1, 4096, 512))
        tokens = runner.tokenizer.tokenizer.encode(text).ids[:1024]
        ppl[fmt] = perplexity(runner, tokens)
    assert 2 < ppl["f32"] < 60, ppl  # a working 135M model on plain English prose
    assert abs(ppl["q8_0"] / ppl["f32"] - 1) < 0.01, ppl
