"""How the user may name things on the command line: `-sm` as nvcc spells it, and a bare model
name (`Qwen3-8B`) looked up in the local Hugging Face cache, never guessed into a download."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tallow.cli.main import build_parser, main

REVISION = "0123456789abcdef0123456789abcdef01234567"


def test_single_dash_sm_is_the_same_option():
    args = build_parser().parse_args(
        ["compile", "--model", "m", "--target", "cuda", "-sm", "80", "--sm", "90"]
    )
    assert args.sms == [80, 90]


def test_single_dash_sm_reaches_target_checks(capsys):
    # Not "unrecognized arguments": -sm is parsed and judged like --sm.
    code = main(["compile", "--model", "m", "--target", "cpu", "-sm", "90"])
    assert code == 2 and "--sm applies to --target cuda only" in capsys.readouterr().err


def _cache_with(tmp_path, source, *repos: str):
    hub = tmp_path / "hf" / "hub"
    for repo in repos:
        folder = hub / ("models--" + repo.replace("/", "--"))
        shutil.copytree(source, folder / "snapshots" / REVISION)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(REVISION)
    return tmp_path / "hf"


def _resolve(name: str, hf_home) -> subprocess.CompletedProcess:
    # huggingface_hub reads HF_HOME / HF_HUB_OFFLINE when imported: a fresh process.
    script = (
        "import sys\n"
        "from tallow.compiler.source import resolve_source\n"
        "from tallow.runtime.errors import ModelSourceError\n"
        "try:\n"
        f"    s = resolve_source({name!r})\n"
        "except ModelSourceError as e:\n"
        "    print(e); sys.exit(2)\n"
        "print(s.hub_id, s.config['architectures'][0], s.folder)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home)}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )


def test_bare_name_resolves_to_the_one_cached_repository(tiny_model_dir, tmp_path):
    hf = _cache_with(tmp_path, tiny_model_dir("qwen3"), "Qwen/Qwen3-Tiny", "other/Unrelated")
    proc = _resolve("qwen3-tiny", hf)  # case-insensitive, as hub names are
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hub_id, arch, folder = proc.stdout.split()
    assert hub_id == "Qwen/Qwen3-Tiny" and arch == "Qwen3ForCausalLM" and REVISION in folder


def test_bare_name_not_cached_names_the_org_form(tmp_path):
    (tmp_path / "hf" / "hub").mkdir(parents=True)
    proc = _resolve("Qwen3-8B", tmp_path / "hf")
    assert proc.returncode == 2
    assert "did you mean Qwen/Qwen3-8B?" in proc.stdout and "org/name" in proc.stdout


def test_bare_name_with_two_cached_repositories_lists_both(tiny_model_dir, tmp_path):
    hf = _cache_with(tmp_path, tiny_model_dir("qwen3"), "a/Tiny", "b/Tiny")
    proc = _resolve("Tiny", hf)
    assert proc.returncode == 2 and "a/Tiny, b/Tiny" in proc.stdout
