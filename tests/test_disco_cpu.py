"""Disco on the CPU: the import fix starts a ThreadedSession, and the Python collectives
agree with numpy. Each check runs in a fresh interpreter: Disco must be preloaded before
tvm is imported, and a collective gone wrong calls std::terminate."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_threaded_session_starts():
    out = _run(
        """
        from tallow.runtime.disco_runtime import disco
        sess = disco().ThreadedSession(2)
        ids = sess.get_global_func("runtime.disco.worker_id")()
        print(sess.num_workers, [int(ids.debug_get_from_remote(i)[0]) for i in range(2)])
        sess.shutdown()
        """
    )
    assert out.split("\n")[0] == "2 [0, 1]"


def test_disco_refused_in_one_line_after_a_plain_tvm_import():
    out = _run(
        """
        import tvm
        from tallow.runtime.disco_runtime import DiscoUnavailableError, disco
        try:
            disco()
        except DiscoUnavailableError as e:
            print(e)
        """
    )
    assert "tvm was imported before" in out and out.count("\\n") <= 1


def test_two_worker_allreduce_and_broadcast_match_numpy():
    out = _run(
        """
        import numpy as np
        from tallow.runtime import cpu_collective
        from tallow.runtime.disco_runtime import disco
        d = disco()
        cpu_collective.register()
        import tvm
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal((3, 5)).astype("float32") for _ in range(2)]
        sess = d.ThreadedSession(2)
        a, b, c = (sess.empty((3, 5), "float32") for _ in range(3))
        for i, x in enumerate(xs):
            a.debug_copy_from(i, tvm.runtime.tensor(x))
        sess.allreduce(a, b, "sum")
        sess.broadcast_from_worker0(a, c)
        sess._sync_all()
        for i in range(2):
            got = b.debug_get_from_remote(i).numpy()
            print(float(np.abs(got - (xs[0] + xs[1])).max()))
            print(float(np.abs(c.debug_get_from_remote(i).numpy() - xs[0]).max()))
        """
    )
    errors = [float(v) for v in out.split()]
    assert len(errors) == 4 and max(errors) < 1e-6
