"""`tallow inspect`, `compile --context-window/--name/--overwrite` and `generate --system/--seed/
--top-k/--prompt -`, run in-process through `main()`, each checked by its effect."""

from __future__ import annotations

import io
import re

import jinja2
import pytest
import yaml
from tokenizers import Tokenizer

from tallow.cli.main import main

pytestmark = pytest.mark.slow  # compiles the tiny model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def art(tiny_artifact):
    return tiny_artifact("qwen3", "f32")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def generate(capsys, art, *args: str) -> tuple[str, str]:
    """Greedy unless `args` say otherwise (a later flag wins)."""
    base = ("generate", str(art), "--max-tokens", "12", "--ignore-eos", "--temperature", "0")
    code, out, err = run(capsys, *base, *args)
    assert code == 0, err
    return out, err


def prompt_tokens(err: str) -> int:
    return int(re.search(r"prompt (\d+) tokens", err).group(1))


def test_inspect_full_prints_the_manifest(capsys, art):
    code, out, err = run(capsys, "inspect", str(art), "--full")
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed == yaml.safe_load((art / "manifest.yaml").read_text())
    assert printed["model"]["architecture"] == "Qwen3ForCausalLM"
    assert printed["kv_cache"]["page_size"] == 16 and printed["libraries"][0]["device"] == "cpu"


def test_inspect_summarises(capsys, art):
    """A dozen lines with the facts a user looks for, each checked against the manifest's
    YAML (issue 35: inspect printed the whole manifest, ~1,350 lines for SmolLM2)."""
    code, out, err = run(capsys, "inspect", str(art))
    assert code == 0, err
    m = yaml.safe_load((art / "manifest.yaml").read_text())
    lines = out.splitlines()
    assert len(lines) <= 16
    field = {line.split(":", 1)[0]: line.split(":", 1)[1] for line in lines if ":" in line}
    assert m["model"]["name"] in field["model"] and m["model"]["architecture"] in field["model"]
    assert field["weights"].startswith(f" {m['quantization']}, {len(m['params'])} tensors")
    assert f"context window {m['kv_cache']['context_window']} tokens" in field["KV cache"]
    for lib in m["libraries"]:
        assert f"  {lib['file']}: {lib['target']} ({lib['platform']})" in lines
    assert "--full" in lines[-1]


def test_compile_name_context_window_and_overwrite(capsys, tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("qwen3"))
    base = ["compile", "--model", model, "--output", str(tmp_path), "--name", "mine", "--quiet"]
    code, out, err = run(capsys, *base, "--context-window", "128")
    assert code == 0, err
    folder = tmp_path / "mine"
    assert out.strip() == str(folder) and [p.name for p in tmp_path.iterdir()] == ["mine"]
    manifest = yaml.safe_load((folder / "manifest.yaml").read_text())
    assert manifest["kv_cache"]["context_window"] == 128
    # Again without --overwrite: refused, with the reason, and the artifact left as it was.
    before = (folder / "manifest.yaml").read_bytes()
    code, out, err = run(capsys, *base, "--context-window", "64")
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert (folder / "manifest.yaml").read_bytes() == before
    # With --overwrite: replaced (the new context window is in the manifest).
    code, out, err = run(capsys, *base, "--context-window", "64", "--overwrite")
    assert code == 0, err
    manifest = yaml.safe_load((folder / "manifest.yaml").read_text())
    assert manifest["kv_cache"]["context_window"] == 64
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


def test_generate_prompt_from_stdin(capsys, monkeypatch, art):
    expected, _ = generate(capsys, art, "--prompt", PROMPT)
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
    got, err = generate(capsys, art, "--prompt", "-")
    assert got == expected
    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    assert prompt_tokens(err) == len(tok.encode(PROMPT).ids)
    # Other text on stdin, another output: the prompt is what stdin holds.
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time"))
    other, _ = generate(capsys, art, "--prompt", "-")
    assert other != expected


def test_generate_system_message_reaches_the_template(capsys, art):
    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    template = jinja2.Environment().from_string((art / "chat_template.jinja").read_text())
    system = "You are terse."
    for extra, messages in (
        ((), [{"role": "user", "content": PROMPT}]),
        (
            ("--system", system),
            [{"role": "system", "content": system}, {"role": "user", "content": PROMPT}],
        ),
    ):
        _, err = generate(capsys, art, "--prompt", PROMPT, "--chat", *extra)
        text = template.render(messages=messages, add_generation_prompt=True)
        assert prompt_tokens(err) == len(tok.encode(text, add_special_tokens=False).ids)


def test_generate_seed_and_top_k(capsys, art):
    greedy, _ = generate(capsys, art, "--prompt", PROMPT, "--temperature", "0")
    sample = ("--prompt", PROMPT, "--temperature", "5")
    a, _ = generate(capsys, art, *sample, "--seed", "1")
    b, _ = generate(capsys, art, *sample, "--seed", "1")
    c, _ = generate(capsys, art, *sample, "--seed", "2")
    assert a == b and a != c and a != greedy  # the seed reproduces, and the sampling is real
    for seed in ("1", "2"):
        k1, _ = generate(capsys, art, *sample, "--seed", seed, "--top-k", "1")
        assert k1 == greedy


def test_generate_applies_the_manifests_sampling_defaults(capsys, art, tmp_path):
    import dataclasses
    import shutil

    from tallow.runtime.manifest import Manifest
    from tallow.runtime.sampling_defaults import SamplingDefaults

    greedy, _ = generate(capsys, art, "--prompt", PROMPT)
    mine = tmp_path / "art"
    shutil.copytree(art, mine)
    manifest = Manifest.read(mine)
    said = SamplingDefaults(temperature=0.0, source="test")
    dataclasses.replace(manifest, sampling_defaults=said).write(mine)

    def plain(*args: str) -> str:  # no --temperature unless given
        code, out, err = run(capsys, "generate", str(mine), "--max-tokens", "12", *args)
        assert code == 0, err
        return out

    assert plain("--prompt", PROMPT, "--ignore-eos") == greedy  # the model's temperature 0
    # OpenAI's temperature 1 instead: sampled (one of two seeds differs from greedy).
    openai = ("--prompt", PROMPT, "--ignore-eos", "--sampling-defaults", "openai")
    assert any(plain(*openai, "--seed", s) != greedy for s in ("1", "2"))


def test_a_text_file_as_the_artifact_is_named_as_such(capsys, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    code, _, err = run(capsys, "generate", str(notes), "--prompt", "x")
    assert code == 2 and err == (
        f"error: {notes} is a file, not an artifact folder (the folder `tallow compile` "
        "writes, holding manifest.yaml)\n"
    )
