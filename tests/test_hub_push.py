"""`tallow push`: what it would upload (`--dry-run`, no network), the model card, and the one
commit it hands huggingface_hub (HfApi replaced by a recorder: no hub here)."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import ModelCard

from tallow.cli.main import main
from tallow.cli.model_card import render_model_card
from tallow.runtime.manifest import Manifest

CARD_MARK = "--- README.md ---"


@pytest.fixture
def art(tiny_artifact, tmp_path) -> Path:
    folder = Path(shutil.copytree(tiny_artifact("qwen3", "f32"), tmp_path / "art"))
    (folder / "notes.txt").write_text("a file the manifest does not record")
    return folder


class NoNetwork:
    def __init__(self, *args, **kwargs):
        raise AssertionError("--dry-run must not talk to the hub")


def listed(out: str) -> dict[str, int]:
    """The dry run's file list: `size  name` lines before the card."""
    files = {}
    for line in out.split(CARD_MARK)[0].splitlines():
        size, name = line.split(maxsplit=1)
        files[name] = int(size.replace(",", ""))
    return files


def test_dry_run_lists_exactly_the_files_and_the_card(art, capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "HfApi", NoNetwork)
    assert main(["push", str(art), "hf://me/tiny-qwen3", "--dry-run", "--private"]) == 0
    out, err = capsys.readouterr()
    files = listed(out)
    card_text = out.split(CARD_MARK + "\n", 1)[1]
    on_disk = {str(p.relative_to(art)) for p in art.rglob("*") if p.is_file()}
    assert set(files) == (on_disk - {"notes.txt"}) | {"README.md (generated model card)"}
    for name, size in files.items():
        if name != "README.md (generated model card)":
            assert size == (art / name).stat().st_size, name
    assert files["README.md (generated model card)"] == len(card_text.rstrip("\n").encode()) + 1
    assert "not uploaded (the manifest does not record it): notes.txt" in err
    assert "hf://me/tiny-qwen3 (revision main, private)" in err
    # Compiled with --cpu native (the tests' default): not a library to publish (docs/ci.md).
    (lib,) = Manifest.read(art).libraries
    assert f"warning: {lib.file} was compiled with --cpu native" in err
    # The card, read by huggingface_hub's own parser.
    m = Manifest.read(art)
    card = ModelCard(card_text)
    assert card.data.library_name == "tallow"
    assert {"tallow", "tvm", m.quantization, "cpu"} <= set(card.data.tags)
    assert card.data.base_model is None  # compiled from a local folder
    assert card.data.pipeline_tag == "text-generation"
    for fact in (
        m.tallow_version,
        m.tvm_version,
        m.model.architecture,
        m.libraries[0].file,
        m.quantization,
    ):
        assert fact in card.text, fact
    assert "tallow serve hf://me/tiny-qwen3" in card.text


def test_card_links_a_hub_source_model(art):
    m = Manifest.read(art)
    m.model = dataclasses.replace(m.model, source="Qwen/Qwen3-0.6B")
    card = ModelCard(render_model_card(m, "me/qwen3-0.6b-tallow", {m.libraries[0].file: 2**21}))
    assert card.data.base_model == "Qwen/Qwen3-0.6B"
    assert "[Qwen/Qwen3-0.6B](https://huggingface.co/Qwen/Qwen3-0.6B)" in card.text
    assert (
        f"| `{m.libraries[0].file}` | {m.libraries[0].target} (" in card.text
        and "| 2.0 MiB |" in card.text
    )
    # It links only the source model, and installs tallow the ways that work (issue 35:
    # `pip install tallow` named a PyPI package that is not this project).
    assert set(re.findall(r"https?://[^\s)]+", card.text)) == {
        "https://huggingface.co/Qwen/Qwen3-0.6B"
    }
    installs = re.findall(r"`pip install ([^`]+)`", card.text)
    assert installs == [".", f"tallow-{m.tallow_version}-py3-none-any.whl"], installs


def test_a_damaged_artifact_is_not_pushed(art, capsys):
    m = Manifest.read(art)
    with open(art / m.libraries[0].file, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0x01]))
    assert main(["push", str(art), "hf://me/tiny-qwen3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"not pushed, damaged or missing: {m.libraries[0].file} (sha256" in err


class RecordingHub:
    calls: list[tuple[str, dict]] = []

    def __init__(self, *args, **kwargs):
        pass

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kw}))

    def create_branch(self, repo_id, **kw):
        self.calls.append(("create_branch", {"repo_id": repo_id, **kw}))

    def create_commit(self, repo_id, operations, **kw):
        self.calls.append(("create_commit", {"repo_id": repo_id, "operations": operations, **kw}))
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/1"})


def test_push_is_one_commit_of_the_listed_files(art, capsys, monkeypatch):
    assert main(["push", str(art), "hf://me/tiny-qwen3", "--dry-run"]) == 0
    dry = capsys.readouterr().out
    RecordingHub.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHub)
    assert main(["push", str(art), "hf://me/tiny-qwen3@v1", "--private"]) == 0
    out, err = capsys.readouterr()
    assert [c[0] for c in RecordingHub.calls] == ["create_repo", "create_branch", "create_commit"]
    assert RecordingHub.calls[0][1]["private"] is True
    assert RecordingHub.calls[1][1]["branch"] == "v1"
    commit = RecordingHub.calls[2][1]
    assert commit["revision"] == "v1"
    ops = {op.path_in_repo: op for op in commit["operations"]}
    expected = {name.split(" (")[0] for name in listed(dry)}
    assert set(ops) == expected
    with ops["README.md"].as_file() as f:
        assert f.read().decode() == dry.split(CARD_MARK + "\n")[1][:-1]
    with ops[Manifest.read(art).libraries[0].file].as_file() as f:
        assert f.read() == (art / Manifest.read(art).libraries[0].file).read_bytes()
    assert "tallow serve hf://me/tiny-qwen3@v1" in out and "pushed:" in err


def test_a_named_cpu_level_is_not_warned_about(art):
    from tallow.cli.hub import publishing_warnings

    m = Manifest.read(art)
    assert len(publishing_warnings(m)) == 1
    m.libraries = [dataclasses.replace(lib, cpu_level="x86-64-v3") for lib in m.libraries]
    assert publishing_warnings(m) == []
