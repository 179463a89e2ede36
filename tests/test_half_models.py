"""Whole tiny models with half-precision activations (issue 19): quantized weights at f16
against transformers at f16, every `--kv-dtype` against the f32 cache, the manifest's KV
fields and the runtime's page size from them, and a CUDA build (SASS, no run) of a
quantized model in its natural f16. Real compiles: slow."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gpu_targets import needs_nvcc
from test_quant_model import PROMPTS, dequantized_twin, logits_of, manifest_of, stored_types

from tallow.compiler.cuda_build import fatbin_entries
from tallow.compiler.pipeline import CompileOptions, compile_model
from tallow.runtime.engine_factory import EngineOptions, plan_kv_cache
from tallow.runtime.manifest import Manifest
from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

pytestmark = pytest.mark.slow

UNIT_ROUNDOFF = {"f16": 2.0**-11, "bf16": 2.0**-8}


def _prompt_and_decode_logits(artifact) -> np.ndarray:
    """Logits of two prompts' prefill, then of three decode steps reading the cache."""
    runner = TVMModelRunner(artifact, kv=KVCacheConfig(4, 512, 64))
    for i in range(len(PROMPTS)):
        runner.add_sequence(i)
    out = [np.asarray(runner.forward([(i, p) for i, p in enumerate(PROMPTS)]))]
    for step in range(3):
        out.append(np.asarray(runner.forward([(0, [7 + step]), (1, [9 + step])])))
    return np.concatenate(out)


@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_kv_dtype_against_the_f32_cache(kv, tiny_model_dir, tiny_artifact, tmp_path):
    """f32 activations, the cache (and so attention) in `kv`. Tolerance 16 u max|logit|
    (u: the cache dtype's unit roundoff): every cached key and value is rounded once, and
    the error passes through softmax and two layers. Measured on this tiny Qwen3: f16
    0.0092 of 6.96 (0.13%, 1/6 of the bound), bf16 0.047 (0.7%, 1/9)."""
    ref = _prompt_and_decode_logits(tiny_artifact("qwen3"))
    art = compile_model(
        CompileOptions(model=str(tiny_model_dir("qwen3")), kv_dtype=kv, output=tmp_path, quiet=True)
    )
    manifest = Manifest.read(art)
    assert manifest.dtype == "float32"
    assert manifest.kv_cache.dtype == {"f16": "float16", "bf16": "bfloat16"}[kv]
    assert manifest.kv_cache.page_size == 16
    cfg = manifest.model.config
    # 2 bytes a value: a key and a value per layer and KV head, 16 tokens a page
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    assert manifest.kv_cache.bytes_per_page() == 16 * per_token
    # the serving engine's page pool: a 1 MiB budget holds whole pages of that size
    plan = plan_kv_cache(manifest, EngineOptions(max_num_seqs=64, kv_cache_mem_mb=1.0), 0)
    assert plan.bytes_per_token == per_token
    assert plan.total_tokens == 2**20 // (16 * per_token) * 16
    got = _prompt_and_decode_logits(art)
    err = np.abs(got - ref).max()
    assert 0 < err <= 16 * UNIT_ROUNDOFF[kv] * np.abs(ref).max()


def test_f16_quantized_model_against_transformers_f16(tiny_model_dir, tmp_path):
    """q4k:all weights, f16 activations and cache, against transformers running the same
    weights (gguf's dequantization, as f16) in float16 on the CPU. Both round activations to
    f16 (u = 2**-11) at different points through two layers: tolerance 32 u max|logit|
    (1.6%). Measured: 0.028 of 10.6 (0.27%, 1/6 of the bound); against transformers in f32
    on the same weights 0.022."""
    import transformers

    src = tiny_model_dir("qwen2_wide")  # rows of 256: every matrix holds K-quant blocks
    art = compile_model(
        CompileOptions(model=str(src), dtype="f16", quant="q4k:all", output=tmp_path, quiet=True)
    )
    m = manifest_of(art)
    assert art.name == "qwen2_wide-q4k-f16-cpu"
    assert (m["dtype"], m["kv_cache"]["dtype"]) == ("float16", "float16")
    twin = dequantized_twin(src, tmp_path / "twin", stored_types(m, src))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        twin, dtype=torch.float16, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = np.stack(
            [hf(torch.tensor([p])).logits[0, -1].float().numpy() for p in PROMPTS]
        ).astype(np.float64)
    got = logits_of(art)
    err = np.abs(got - ref).max()
    assert err <= 32 * UNIT_ROUNDOFF["f16"] * np.abs(ref).max(), err


@needs_nvcc
def test_cuda_build_of_a_quantized_model_in_natural_f16(tiny_model_dir, tmp_path):
    """No --dtype: f16 on CUDA for an f32 checkpoint; the cache in f32 (attention computed
    in f32 on f16 activations: the up-casting side of the KV view). Built, not run."""
    art = compile_model(
        CompileOptions(
            model=str(tiny_model_dir("qwen3")),
            target="cuda",
            sms=[90],
            quant="q4_0:all",
            kv_dtype="f32",
            output=tmp_path,
            quiet=True,
            decode_buckets=(),  # no static-row batch decodes: their compile time, not checked here
        )
    )
    manifest = Manifest.read(art)
    assert art.name == "qwen3-q4_0-f16-cuda-sm_90"
    assert (manifest.dtype, manifest.kv_cache.dtype) == ("float16", "float32")
    assert manifest.dtype_source.startswith("natural for cuda")
    assert {p.quant for p in manifest.params} >= {"q4_0"}
    (lib,) = manifest.libraries
    assert sorted(fatbin_entries(art / lib.file)) == [("sass", 90)]  # SASS, built by nvcc
