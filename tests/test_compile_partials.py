"""A killed compile's hidden .partial folder is removed by the next compile into the same
output folder, once its owning process is gone; never while the owner lives."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from tallow.compiler import pipeline
from tallow.compiler.pipeline import OWNER_FILE, CompileOptions, CompileState, make_work_dir
from tallow.compiler.progress import Progress


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _partial(out, name, owner):
    d = out / f".{name}.abc123.partial"
    d.mkdir(parents=True)
    (d / "params_00000.safetensors").write_bytes(b"x" * 100)
    if owner is not None:
        (d / OWNER_FILE).write_text(json.dumps(owner))
    return d


def _state(out):
    return CompileState(options=CompileOptions(model="x", output=out), progress=Progress(True))


def test_next_compile_removes_partials_of_dead_owners(tmp_path):
    host = socket.gethostname()
    dead = _partial(tmp_path, "m", {"pid": _dead_pid(), "host": host, "start": None})
    alive = _partial(tmp_path, "n", {"pid": os.getpid(), "host": host, "start": None})
    other_host = _partial(tmp_path, "o", {"pid": _dead_pid(), "host": host + "-x", "start": None})
    no_record = _partial(tmp_path, "p", None)
    state = _state(tmp_path)
    make_work_dir(state, "m")
    assert not dead.exists()
    assert alive.exists() and other_host.exists() and no_record.exists()
    # the new partial folder records its owner: this process
    owner = json.loads((state.work_dir / OWNER_FILE).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == host
    # ...so a concurrent compile leaves it alone
    assert pipeline.remove_stale_partials(tmp_path) == []
    assert state.work_dir.exists()


def test_a_reused_pid_does_not_keep_a_partial_alive(tmp_path):
    me = os.getpid()
    start = pipeline._start_time(me)
    if start is None:
        return  # no /proc: the PID check alone applies
    stale = _partial(tmp_path, "m", {"pid": me, "host": socket.gethostname(), "start": "1"})
    assert pipeline.remove_stale_partials(tmp_path) == [stale]
