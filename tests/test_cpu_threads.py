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

from tallow.runtime.cpu_threads import configure_cpu_threads
from tallow.runtime.errors import TallowError


def _pool_size(art, threads: int | None, env: dict, affinity: set[int] | None = None) -> int:
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
        preexec_fn=None if affinity is None else lambda: os.sched_setaffinity(0, affinity),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pool_leaves_one_cpu_free_by_default(tiny_artifact):
    """Every usable CPU but one (a pinned, spinning pool collapses when a neighbour takes a
    core: runtime/cpu_threads.py), and one on a single CPU."""
    art = tiny_artifact("qwen3", "f32")
    cpus = len(os.sched_getaffinity(0))
    assert _pool_size(art, None, {}) == max(1, cpus - 1)
    assert _pool_size(art, None, {}, affinity={min(os.sched_getaffinity(0))}) == 1


def test_threads_option_and_user_environment_win(tiny_artifact):
    art = tiny_artifact("qwen3", "f32")
    assert _pool_size(art, 1, {}) == 1
    assert _pool_size(art, None, {"TVM_NUM_THREADS": "1"}) == 1


def test_bad_thread_count_is_refused(monkeypatch):
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    with pytest.raises(TallowError, match="--threads must be at least 1"):
        configure_cpu_threads(0)
