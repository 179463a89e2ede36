"""The package builds into a wheel without setuptools warnings and with the chat page's files
(issue 35, items 3 and 5): the wheel is how tallow installs off a clone (docs/ci.md builds it
with `python -m build`). Built here with the environment's setuptools, offline (2 s)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_version() -> tuple[int, ...]:
    try:
        import setuptools
    except ImportError:
        return (0,)
    return tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if _setuptools_version() < (77,):
        pytest.skip("needs setuptools >= 77 (pyproject's build requirement) in this environment")
    out = tmp_path_factory.mktemp("wheel")
    # A copy: setuptools leaves build/ in the tree it builds, and a stale one would put
    # files deleted since into the wheel.
    src = out / "src"
    skip = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "artifacts")
    shutil.copytree(ROOT, src, ignore=skip)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = out.glob("tallow-*.whl")
    return built, proc.stdout + proc.stderr


def test_the_build_warns_about_nothing(wheel):
    _, log = wheel
    for warning in ("BuildBackendWarning", "SetuptoolsDeprecationWarning", "is absent from"):
        assert warning not in log, [line for line in log.splitlines() if warning in line]


def test_the_wheel_holds_the_chat_page_and_a_license_expression(wheel):
    built, _ = wheel
    with zipfile.ZipFile(built) as z:
        names = set(z.namelist())
        metadata = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    ui = {n.rsplit("/", 1)[-1] for n in names if n.startswith("tallow/server/ui/")}
    shipped = {p.name for p in (ROOT / "server" / "ui").iterdir() if p.is_file()}
    assert ui == shipped and {"index.html", "chat.js"} <= ui
    assert "License-Expression: Apache-2.0" in metadata
    # Every Python file of the source tree's packages is in the wheel (a subpackage missing
    # from pyproject's `packages` list is left out silently: the i-quant, lattice and low-bit
    # format packages once were).
    source = {
        f"tallow/{f.relative_to(ROOT).as_posix()}"
        for top in ("cli", "compiler", "model_defs", "runtime", "schedules", "server")
        for f in (ROOT / top).rglob("*.py")
        if "__pycache__" not in f.parts
    }
    assert "tallow/compiler/quant/lowbit/numpy_codec.py" in source
    assert source - names == set()
    native = {"tallow/runtime/native/disco_nccl.cc", "tallow/runtime/native/shim/tvm/support/io.h"}
    assert native <= names
