"""The GPU check's device half (`benchmarks/gpu_check_run.py`) on CPU artifacts.

A GPU is lent to a session rarely and for minutes: a script that breaks between two such
sessions wastes one. Its commands run here on a CPU artifact (`--device cpu`), the same code
paths but the device: the parity of `batch_decode` and of the one-sequence `decode` (a CPU
against itself: zero difference, and both paths taken), and the speed table's rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_check_run.py"


def _run(*args: str) -> str:
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}  # as on the GPU machine: runtime only
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_parity_takes_both_decode_functions(tiny_artifact):
    art = str(tiny_artifact("qwen3", "f32"))
    out = _run("parity", art, art)
    assert "PARITY batch_decode OK: worst 0.00e+00" in out
    assert "PARITY decode OK: worst 0.00e+00" in out


def test_speed_prints_every_batch_against_the_roofline(tiny_artifact):
    out = _run("speed", str(tiny_artifact("qwen3", "f32")), "--gpu", "H100")
    rows = [line for line in out.splitlines() if line.startswith("decode")]
    labels = [line.split(":")[0] for line in rows]
    assert labels == [
        "decode batch  1",
        "decode (one-sequence fn)",
        "decode batch 12",
        "decode batch 16",
        "decode batch 64",
    ]
    assert all("of the bound" in line for line in rows)
