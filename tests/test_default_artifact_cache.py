"""`tallow serve` without an artifact compiles the default model into the user's cache, once
per user (issue 35: it compiled into ./artifacts of every working directory): the folder
$TALLOW_CACHE_DIR names, else $XDG_CACHE_HOME/tallow, else ~/.cache/tallow. The compile and
the engine are stood in for: what is checked is which folder serve reads or writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tallow.cli import serve as cli_serve

NAME = "smollm2-135m-instruct-q4_1-cpu"


@pytest.fixture
def env(monkeypatch, tmp_path):
    # TVM_USE_RUNTIME_LIB: serve sets it in this process; monkeypatch undoes that after.
    for var in ("TALLOW_CACHE_DIR", "XDG_CACHE_HOME", "TVM_USE_RUNTIME_LIB"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_the_cache_folder_follows_the_environment(env, tmp_path):
    assert cli_serve.cache_dir() == tmp_path / "home" / ".cache" / "tallow"
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli_serve.cache_dir() == tmp_path / "xdg" / "tallow"
    env.setenv("TALLOW_CACHE_DIR", str(tmp_path / "mine"))
    assert cli_serve.default_artifact() == tmp_path / "mine" / NAME


# In a child process: serve imports TVM in runtime-only mode, which would stay so for the
# rest of this test session. The compile and the engine are replaced by recorders.
SCRIPT = """
import json, sys
from pathlib import Path
import tallow.compiler.pipeline, tallow.runtime.engine_factory
from tallow.cli.main import main
from tallow.runtime.errors import TallowError
seen = {"compiled": [], "served": []}

def fake_compile(options):
    seen["compiled"].append([options.model, str(options.output), options.name])
    folder = options.output / options.name
    folder.mkdir(parents=True)
    (folder / "manifest.yaml").write_text("format_version: 2\\n")
    return folder

def fake_engine(folder, options):
    seen["served"].append(str(folder))
    raise TallowError("stop here")

tallow.compiler.pipeline.compile_model = fake_compile
tallow.runtime.engine_factory.build_engine = fake_engine
codes = [main(["serve", "--port", "0"]) for _ in range(2)]
print(json.dumps({"codes": codes, **seen}))
"""


def test_serve_compiles_into_the_cache_once_then_serves_from_it(env, tmp_path):
    env.setenv("TALLOW_CACHE_DIR", str(tmp_path / "cache"))
    work = tmp_path / "somewhere"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=work, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["codes"] == [2, 2]
    # Compiled once, into the cache; the second start finds it there.
    assert got["compiled"] == [["default", str(tmp_path / "cache"), NAME]]
    assert got["served"] == [str(tmp_path / "cache" / NAME)] * 2
    assert not (work / "artifacts").exists()
    assert f"compiling the default model into {tmp_path / 'cache' / NAME}" in proc.stderr
