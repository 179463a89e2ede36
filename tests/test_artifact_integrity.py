"""Damaged artifacts: checksums recorded at compile time, `tallow verify`, and the checks at
load (sizes, sampled shard hashes, tokenizer and template in full). One tiny compile."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tallow.runtime import integrity
from tallow.runtime.artifact import check_artifact_files, load_tokenizer
from tallow.runtime.errors import ArtifactError
from tallow.runtime.manifest import Manifest


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tallow.cli.main", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "TVM_USE_RUNTIME_LIB": "1"},
        timeout=timeout,
    )


@pytest.fixture
def art(tiny_artifact, tmp_path) -> Path:
    """A private copy of the tiny artifact, to damage."""
    return Path(shutil.copytree(tiny_artifact("qwen3", "f32"), tmp_path / "art"))


def _shard(art: Path) -> Path:
    return art / Manifest.read(art).params[0].shard


def _damage(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_manifest_records_every_file(art):
    m = Manifest.read(art)
    assert m.checksums is not None
    shards = {p.shard for p in m.params}
    # Every file but the manifest itself: weights, tokenizer, template and the libraries.
    on_disk = {str(p.relative_to(art)) for p in art.rglob("*") if p.is_file()}
    assert set(m.checksums) == on_disk - {"manifest.yaml"}
    assert shards | {"tokenizer.json", "chat_template.jinja"} <= set(m.checksums)
    assert {lib.file for lib in m.libraries} <= set(m.checksums)
    for name, entry in m.checksums.items():
        assert entry["size"] == (art / name).stat().st_size
        assert entry["sha256"] == integrity.sha256_file(art / name)
        assert ("sample_sha256" in entry) == (name in shards)
    proc = run_cli("verify", str(art))
    assert proc.returncode == 0, proc.stderr
    assert "BAD" not in proc.stdout and "verified" in proc.stderr


def test_random_bytes_inside_the_weights(art):
    shard = _shard(art)
    _damage(shard, shard.stat().st_size // 2, os.urandom(4096))
    proc = run_cli("verify", str(art))
    assert proc.returncode == 1
    assert f"BAD {shard.name}" in proc.stdout and shard.name in proc.stderr
    with pytest.raises(ArtifactError, match=f"{shard.name} is damaged"):
        check_artifact_files(art, Manifest.read(art))


def test_truncated_shard_fails_the_size_check(art):
    shard = _shard(art)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    with pytest.raises(ArtifactError, match=f"{shard.name} is damaged \\(size"):
        check_artifact_files(art, Manifest.read(art))


def test_corrupt_tokenizer_is_one_error_line_before_serving(art):
    _damage(art / "tokenizer.json", 10, b"\x00garbage{{{")
    proc = run_cli("serve", str(art), "--port", "1", "--kv-cache-mem", "8")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "serving" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "tokenizer.json is damaged" in errors[0]


def test_damaged_chat_template_is_caught(art):
    _damage(art / "chat_template.jinja", 0, b"{% if")
    proc = run_cli("verify", str(art))
    assert proc.returncode == 1 and "BAD chat_template.jinja" in proc.stdout
    with pytest.raises(ArtifactError, match="chat_template.jinja is damaged"):
        check_artifact_files(art, Manifest.read(art))


def _drop_checksums(art: Path) -> None:
    raw = yaml.safe_load((art / "manifest.yaml").read_text())
    del raw["checksums"]
    (art / "manifest.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def test_older_artifact_without_checksums_still_loads(art, caplog):
    _drop_checksums(art)
    m = Manifest.read(art)
    assert m.checksums is None
    with caplog.at_level(logging.WARNING):
        check_artifact_files(art, m)
    assert "no checksums recorded" in caplog.text
    assert load_tokenizer(art, m).tokenizer.get_vocab_size() > 0
    proc = run_cli("verify", str(art))
    assert proc.returncode == 1 and "no checksums recorded" in proc.stderr


def test_older_artifact_with_bad_tokenizer_or_template_fails_clearly(art):
    _drop_checksums(art)
    (art / "tokenizer.json").write_text('{"not": "a tokenizer"')
    with pytest.raises(ArtifactError, match="tokenizer.json is damaged or unreadable"):
        load_tokenizer(art, Manifest.read(art))
    shutil.copy(_pristine(art) / "tokenizer.json", art / "tokenizer.json")
    (art / "chat_template.jinja").write_text("{% for x in %}")
    proc = run_cli("serve", str(art), "--port", "1", "--kv-cache-mem", "8")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "serving" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "template" in errors[0]


def _pristine(art: Path) -> Path:
    src = yaml.safe_load((art / "manifest.yaml").read_text())["model"]["source"]
    return Path(src)


def test_sample_windows_cover_a_large_file(tmp_path):
    big = tmp_path / "big.bin"
    size = integrity.NUM_WINDOWS * integrity.WINDOW * 3 + 12345
    with open(big, "wb") as f:
        f.truncate(size)
    offsets = integrity.sample_offsets(size)
    assert offsets[0] == 0 and offsets[-1] == size - integrity.WINDOW
    before = integrity.sample_sha256(big)
    _damage(big, offsets[3] + 100, b"\x01" * 4096)  # inside a window: caught
    assert integrity.sample_sha256(big) != before


def _flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)


DAMAGE = {"flipped byte": _flip_byte, "truncated": _truncate, "missing": Path.unlink}
# The checks name each file the way the manifest does; a library is one of them.
FILES = {"weights": lambda m: m.params[0].shard, "library": lambda m: m.libraries[0].file}
FILES["tokenizer"] = lambda m: "tokenizer.json"


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("which", FILES)
def test_each_damage_fails_verify_and_load_naming_the_file(art, capsys, which, damage):
    from tallow.cli.main import main

    m = Manifest.read(art)
    name = FILES[which](m)
    DAMAGE[damage](art / name)
    assert main(["verify", str(art)]) == 1
    out, err = capsys.readouterr()
    bad = [ln for ln in out.splitlines() if ln.startswith("BAD")]
    assert len(bad) == 1 and bad[0].startswith(f"BAD {name}:"), out
    assert ("missing" in bad[0]) == (damage == "missing")
    assert f"1 damaged file(s): {name}" in err
    with pytest.raises(ArtifactError, match=f"{name} (is missing|is damaged)"):
        check_artifact_files(art, m)
