"""`hf://org/repo` artifacts, offline: pulled from a Hugging Face cache laid out as
huggingface_hub lays it (tests/hub_cache.py), never from the network.

The published repository holds the tiny artifact plus a second target's library recorded in
its manifest; the cache holds everything but that library, as on a machine that pulled only
what it runs. The oracle for what a pull fetches is the single-target artifact folder itself.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import huggingface_hub
import pytest
import yaml
from hub_cache import artifact_files, write_cached_repo
from huggingface_hub import constants
from server_helpers import start_process

from tallow.cli.main import main
from tallow.runtime.errors import ArtifactError
from tallow.runtime.hub_pull import files_for_device, parse_hub_ref, pull
from tallow.runtime.manifest import Manifest

REPO = "tallow-test/tiny-qwen3"
OTHER_LIBRARY = "lib/metal-arm64.tar"  # another target's library: never fetched on this CPU


@pytest.fixture(scope="module")
def published(tiny_artifact) -> tuple[dict[str, bytes], Path]:
    """(the repository's files, the local artifact they came from)."""
    art = tiny_artifact("qwen3", "f32")
    files = artifact_files(art)
    other = os.urandom(4096)
    raw = yaml.safe_load(files["manifest.yaml"])
    metal = {**raw["libraries"][0], "file": OTHER_LIBRARY, "device": "metal", "target": "metal"}
    metal.update(platform="macos-arm64", cpu_level=None, cpu_features=[])
    raw["libraries"].append(metal)
    raw["checksums"][OTHER_LIBRARY] = {
        "size": len(other),
        "sha256": hashlib.sha256(other).hexdigest(),
    }
    files["manifest.yaml"] = yaml.safe_dump(raw, sort_keys=False).encode()
    files[OTHER_LIBRARY] = other
    return files, art


@pytest.fixture
def hub_env(tmp_path, monkeypatch) -> dict[str, str]:
    """HF_HOME in tmp, offline; huggingface_hub read its settings at import, so this process
    gets them patched too. Returns the environment for subprocesses."""
    env = {
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),  # tallow's verified-file marks
        "TVM_USE_RUNTIME_LIB": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return {**os.environ, **env}


def cache_as_pulled(published, hf_home: Path) -> Path:
    files, _ = published
    return write_cached_repo(hf_home, REPO, {n: d for n, d in files.items() if n != OTHER_LIBRARY})


def test_pull_fetches_only_what_this_machine_runs(published, hub_env, monkeypatch, capsys):
    _, art = published
    cache_as_pulled(published, Path(hub_env["HF_HOME"]))
    asked: list[list[str]] = []
    real = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        asked.append(sorted(kwargs["allow_patterns"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    folder = pull(parse_hub_ref(f"hf://{REPO}"), files_for_device(None))
    # Exactly the single-target artifact's files: weights, tokenizer, template, its library.
    assert asked == [sorted(artifact_files(art))]
    assert OTHER_LIBRARY not in asked[0] and not (folder / OTHER_LIBRARY).exists()
    # Generating from the hub reference gives the local artifact's text.
    texts = []
    for spec in (str(art), f"hf://{REPO}"):
        argv = ["generate", spec, "--prompt", "Hello", "--max-tokens", "8", "--temperature", "0"]
        assert main(argv) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
    # inspect reads the manifest only; verify wants every file, and names the one not pulled.
    assert main(["inspect", f"hf://{REPO}", "--full"]) == 0
    libraries = yaml.safe_load(capsys.readouterr().out)["libraries"]
    assert [lib["file"] for lib in libraries] == [
        Manifest.read(art).libraries[0].file,
        OTHER_LIBRARY,
    ]
    assert main(["verify", f"hf://{REPO}"]) == 1
    out = capsys.readouterr().out
    assert f"BAD {OTHER_LIBRARY}: missing" in out and out.count("BAD") == 1


def test_another_machine_pulls_its_own_library(published, hub_env, monkeypatch):
    """The same repository seen from a simulated Mac takes the Metal library (and hashes it);
    an explicit device the artifact cannot serve fails before any download."""
    files, art = published
    write_cached_repo(Path(hub_env["HF_HOME"]), REPO, files)
    asked: list[list[str]] = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        lambda *a, **kw: asked.append(sorted(kw["allow_patterns"])) or real(*a, **kw),
    )
    ref = parse_hub_ref(f"hf://{REPO}")
    pull(ref, files_for_device(None, is_mac=True))
    cpu_library = Manifest.read(art).libraries[0].file
    assert asked == [sorted({*artifact_files(art), OTHER_LIBRARY} - {cpu_library})]
    with pytest.raises(ArtifactError, match="cannot run on cuda: .*the artifact has: .*metal"):
        pull(ref, files_for_device("cuda", cuda_archs=["sm_90"]))
    assert len(asked) == 1


def test_a_changed_file_in_the_cache_is_refused(published, hub_env):
    snapshot = cache_as_pulled(published, Path(hub_env["HF_HOME"]))
    m = Manifest.read(snapshot)
    ref = parse_hub_ref(f"hf://{REPO}@main")
    for name in (m.params[0].shard, m.libraries[0].file):
        blob = (snapshot / name).resolve()
        good = blob.read_bytes()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x01  # same size: only the hash can tell
        blob.write_bytes(bytes(bad))
        with pytest.raises(ArtifactError, match=f"{name} does not match the manifest \\(sha256"):
            pull(ref, files_for_device(None))
        blob.write_bytes(good)
    pull(ref, files_for_device(None))  # the original bytes pass, and are remembered
    # A file changed after it passed is hashed again (its mtime moved), and refused.
    blob = (snapshot / m.libraries[0].file).resolve()
    data = bytearray(blob.read_bytes())
    data[100] ^= 0x01
    time.sleep(0.01)
    blob.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f"{m.libraries[0].file} does not match"):
        pull(ref, files_for_device(None))


def test_offline_without_a_cached_copy_is_one_clear_line(hub_env):
    proc = subprocess.run(
        [sys.executable, "-m", "tallow.cli.main", "generate", f"hf://{REPO}", "--prompt", "x"],
        capture_output=True,
        text=True,
        env=hub_env,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [
        f"error: hf://{REPO} is not in the local Hugging Face cache "
        f"({hub_env['HF_HOME']}/hub) and HF_HUB_OFFLINE is set; pull it once with network "
        "access, or unset HF_HUB_OFFLINE"
    ]


def test_a_malformed_reference_fails_while_parsing(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "hf://only-a-name", "--prompt", "x"])
    assert "namespace/name" in capsys.readouterr().err
    with pytest.raises(ArtifactError, match="whole model repository"):
        parse_hub_ref("hf://datasets/org/data")


def test_serve_a_hub_artifact_from_the_cache(published, hub_env):
    """A subprocess with only the environment: HF_HOME and HF_HUB_OFFLINE honoured."""
    cache_as_pulled(published, Path(hub_env["HF_HOME"]))
    cmd = [sys.executable, "-m", "tallow.cli.main", "serve", f"hf://{REPO}", "--port", "0"]
    server = start_process([*cmd, "--kv-cache-mem", "8", "--no-ui"], env=hub_env)
    proc, base = server.proc, server.base_url
    try:
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["tiny-qwen3"]
        body = {"model": "tiny-qwen3", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
