"""SIGTERM drain of a real server process (the launcher over the fake runner): 503s and a
failing /health while draining, with the listener still open; streams cut at the shutdown
timeout end with an error event and [DONE]; the exit status says whether the drain completed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port

HERE = Path(__file__).parent


def start(shutdown_timeout: float, delay: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "fake_serve.py"), str(port), str(shutdown_timeout), str(delay)],
        env={**os.environ},
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("fake server did not start")


def body(max_tokens: int, stream: bool = True) -> dict:
    return {
        "model": "fake",
        "prompt": "w1 w2 w3",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_drain_past_the_timeout_ends_streams_with_an_error(procs):
    proc, base = start(shutdown_timeout=1.5, delay=0.02)
    procs.append(proc)
    ok = httpx.post(f"{base}/v1/completions", json=body(3, stream=False), timeout=10)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    url = f"{base}/v1/completions"
    with httpx.stream("POST", url, json=body(100_000 // 40), timeout=20) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert first.startswith("data: {")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # The listener is still open: new requests get the documented 503, /health fails.
        refused = httpx.post(url, json=body(2, stream=False), timeout=5)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        rest = [ln for ln in lines if ln]
    assert time.monotonic() - t0 < 10
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2].removeprefix("data: "))
    assert err["error"]["code"] == "shutting_down" and err["error"]["type"] == "server_error"
    assert proc.wait(15) == 1
    assert "Traceback" not in proc.stderr.read()


def test_drain_that_completes_exits_zero(procs):
    proc, base = start(shutdown_timeout=20, delay=0.02)
    procs.append(proc)
    with httpx.stream("POST", f"{base}/v1/completions", json=body(60), timeout=20) as r:
        lines = r.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)
        text = "".join(lines)
    assert text.endswith("data: [DONE]") and '"finish_reason":"length"' in text
    assert proc.wait(15) == 0


def test_idle_server_exits_at_once(procs):
    proc, _ = start(shutdown_timeout=20, delay=0.0)
    procs.append(proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert time.monotonic() - t0 < 8
