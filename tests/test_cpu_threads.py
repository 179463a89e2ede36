"""The runner sizes TVM's CPU thread pool (tallow.runtime.cpu_threads).

TVM on its own takes half the hardware threads on x86, which on a machine without SMT
leaves half the cores idle. Each case runs in a fresh process: the pool is sized once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tallow.runtime.cpu_threads import configure_cpu_threads, usable_cpus
from tallow.runtime.errors import TallowError


def _pool_size(art, threads: int | None, env: dict) -> int:
    script = f"""
import json, tvm
from tallow.runtime.model_runner import TVMModelRunner
r = TVMModelRunner({str(art)!r}, threads={threads!r})
r.add_sequence(0)
r.forward([(0, [1, 2, 3])])
print(json.dumps(tvm.runtime.num_threads()))
"""
    clean = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pool_uses_every_usable_cpu_by_default(tiny_artifact):
    art = tiny_artifact("qwen3", "f32")
    assert _pool_size(art, None, {}) == usable_cpus()


def test_threads_option_and_user_environment_win(tiny_artifact):
    art = tiny_artifact("qwen3", "f32")
    assert _pool_size(art, 1, {}) == 1
    assert _pool_size(art, None, {"TVM_NUM_THREADS": "1"}) == 1


def test_bad_thread_count_is_refused(monkeypatch):
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    with pytest.raises(TallowError, match="--threads must be at least 1"):
        configure_cpu_threads(0)
