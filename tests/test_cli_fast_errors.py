"""Mistakes on the command line are reported before TVM is imported (issue 35, item 2): TVM
takes 4 s to import here and 16-27 s on a busy machine, and a typo used to wait for it. Each
case runs `main()` in a fresh interpreter and checks the exit status, the one `error:` line,
and that `tvm` never entered `sys.modules` (not a timing, so a loaded machine cannot fail it).
`tallow serve` binds its port before loading anything: a port in use is one line, exit 2.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

RUN = """
import json, sys
from tallow.cli.main import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "tvm": "tvm" in sys.modules}))
"""


def run_main(*argv: str, cwd: Path | None = None) -> tuple[int, bool, str]:
    """(exit status, whether TVM was imported, stderr) of `tallow ARGV` in a new process."""
    proc = subprocess.run(
        [sys.executable, "-c", RUN, *argv], capture_output=True, text=True, cwd=cwd, timeout=300
    )
    if proc.returncode != 0:  # argparse exits by itself (SystemExit 2), before the print
        return proc.returncode, False, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["code"], result["tvm"], proc.stderr


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("inputs")
    (base / "notes.txt").write_text("not a model\n")
    (base / "empty").mkdir()
    (base / "fake.gguf").write_bytes(b"not a gguf file at all")
    (base / "model.bin").write_bytes(b"\x80\x04pickle")
    return base


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quant", "q4_x"], "unknown --quant 'q4_x'"),
        (["--kv-dtype", "int8"], "--kv-dtype int8"),
        (["--page-size", "32"], "--page-size 32"),
        (["--context-window", "0"], "--context-window must be at least 1"),
    ],
)
def test_bad_compile_options_fail_before_tvm(argv, message, tmp_path):
    code, tvm, err = run_main("compile", "--model", "default", "--output", str(tmp_path), *argv)
    assert code == 2 and not tvm, err
    assert error_lines(err) == [next(line for line in err.splitlines() if message in line)]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "model, message",
    [
        ("missing-folder/x", "model not found"),
        ("notes.txt", "a file that is not a .gguf"),
        ("empty", "no config.json"),
        ("fake.gguf", "not a readable GGUF file"),
        ("model.bin", "pickle checkpoints are refused"),
    ],
)
def test_bad_model_paths_fail_before_tvm(files, model, message, tmp_path):
    code, tvm, err = run_main(
        "compile", "--model", str(files / model), "--output", str(tmp_path / "out")
    )
    assert code == 2 and not tvm, err
    (line,) = error_lines(err)
    assert line.startswith("error: ") and message in line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--threads", "0"], "argument --threads: must be at least 1"),
        (["--device", "gpu"], "argument --device: bad device 'gpu'"),
        (["--top-k", "-5"], "--top-k: top_k -5 is out of range"),
    ],
)
def test_bad_runtime_options_fail_before_tvm(files, argv, message):
    code, tvm, err = run_main("generate", str(files), "--prompt", "x", *argv)
    assert code == 2 and not tvm, err
    (line,) = error_lines(err)
    assert message in line


def test_serve_reports_a_port_in_use_at_once(files):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # `files` is no artifact: the port is checked first, so that is not what is reported.
        code, tvm, err = run_main("serve", str(files), "--port", str(port))
    assert code == 2 and not tvm, err
    (line,) = error_lines(err)
    assert line.startswith(f"error: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "Traceback" not in err and "Errno" not in err
