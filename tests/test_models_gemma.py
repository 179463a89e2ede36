"""Gemma 2, Gemma 3 and Mistral-with-window tiny models against transformers (issue 22).

Every tiny model attends through windows of 8 positions while the sequences run to 21
(parity), 40 (chunked prefill) and 45 (generation) tokens, so windowed and global layers
both shape the logits (`test_windows_change_the_reference` checks that they do).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf_models import write_gemma_gguf
from test_parity import PROMPTS, hf_last_logits, run_parity, runner_for

from tallow.compiler.pipeline import CompileOptions, compile_model
from tallow.runtime.generate import generate_tokens
from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner
from tallow.runtime.sampling_params import SamplingParams

from tiny_models import load_hf

pytestmark = pytest.mark.slow

WINDOWED = ["gemma2", "gemma3", "mistral_window"]


def test_windows_change_the_reference(tiny_model_dir):
    """Without its window, the same transformers model answers differently: the parity
    tests below could not pass by ignoring the window."""
    folder = tiny_model_dir("gemma3")
    windowed = load_hf(folder)
    full = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype="float32", attn_implementation="eager", sliding_window=4096
    ).eval()
    prompt = PROMPTS[1] + [5, 6, 7, 8, 9, 10, 11, 12]
    diff = np.abs(hf_last_logits(windowed, prompt) - hf_last_logits(full, prompt)).max()
    assert diff > 1e-2


@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_logits_match_transformers_f32(name, tiny_model_dir, tiny_artifact):
    hf = load_hf(tiny_model_dir(name))
    worst, _, picks = run_parity(runner_for(tiny_artifact(name, "f32")), hf)
    assert worst <= 1e-4, f"{name}: max abs logit error {worst}"
    assert [o for o, _, _ in picks] == [r for _, r, _ in picks]


def test_window_across_prefill_chunks(tiny_model_dir, tiny_artifact):
    """A 40-token prompt in chunks of 16: later chunks see earlier ones through the paged
    prefill kernel, which must apply the window across the chunk boundary."""
    hf = load_hf(tiny_model_dir("gemma3"))
    kv = KVCacheConfig(max_batch_size=2, max_total_tokens=512, prefill_chunk_size=16)
    runner = TVMModelRunner(tiny_artifact("gemma3", "f32"), kv=kv)
    prompt = [int(x) for x in np.random.default_rng(3).integers(3, 300, size=40)]
    runner.add_sequence(0)
    for start in range(0, len(prompt), 16):
        logits = runner.forward([(0, prompt[start : start + 16])])
    assert np.abs(logits[0] - hf_last_logits(hf, prompt)).max() <= 1e-4


def test_gemma2_greedy_generation_matches_transformers(tiny_model_dir, tiny_artifact):
    hf = load_hf(tiny_model_dir("gemma2"))
    prompt = PROMPTS[1]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = out[0, len(prompt) :].tolist()
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runner = runner_for(tiny_artifact("gemma2", "f32"))
    assert list(generate_tokens(runner, prompt, params)) == expected


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_matches_transformers(arch, tiny_model_dir, tmp_path):
    """A GGUF laid out as llama.cpp writes Gemma (norms as 1 + w; window pattern, local
    RoPE base and attention scale implied by the architecture) gives transformers' logits
    on the safetensors original."""
    folder = tiny_model_dir(f"{arch}_gguf")
    gguf_path = write_gemma_gguf(folder, tmp_path / f"{arch}.gguf", arch)
    artifact = compile_model(
        CompileOptions(model=str(gguf_path), output=tmp_path / "art", quiet=True)
    )
    worst, _, picks = run_parity(runner_for(artifact), load_hf(folder))
    assert worst <= 1e-4, f"{arch} GGUF: max abs logit error {worst}"
    assert [o for o, _, _ in picks] == [r for _, r, _ in picks]


def test_window_over_a_forked_prefix(tiny_model_dir, tiny_artifact):
    """Two sequences sharing a forked 20-token prefix, decoded together: the cache then
    attends over the shared pages and each sequence's own in separate passes, and the
    window must be measured in positions across both."""
    hf = load_hf(tiny_model_dir("gemma3"))
    runner = runner_for(tiny_artifact("gemma3", "f32"))
    prefix = [int(x) for x in np.random.default_rng(4).integers(3, 300, size=20)]
    runner.add_sequence(0)
    runner.forward([(0, prefix)])
    runner.fork_sequence(0, 1, len(prefix))
    seqs = [prefix + [7], prefix + [9]]
    for _ in range(6):
        ours = runner.forward([(i, [s[-1]]) for i, s in enumerate(seqs)])
        for i, s in enumerate(seqs):
            ref = hf_last_logits(hf, s)
            assert np.abs(ours[i] - ref).max() <= 1e-4
            s.append(int(ref.argmax()))
