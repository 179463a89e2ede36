"""SIGTERM drain of a real server process (the launcher over the fake runner): 503s and a
failing /health while draining, with the listener still open; streams cut at the shutdown
timeout end with an error event and [DONE]; the exit status says whether the drain completed."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import httpx
import pytest
from server_helpers import ServerProcess, start_process, wait_until_draining

HERE = Path(__file__).parent


def start(shutdown_timeout: float, delay: float) -> ServerProcess:
    return start_process(
        [sys.executable, str(HERE / "fake_serve.py"), "0", str(shutdown_timeout), str(delay)]
    )


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
    started: list[ServerProcess] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(10)


def test_drain_past_the_timeout_ends_streams_with_an_error(procs):
    server = start(shutdown_timeout=3.0, delay=0.02)
    procs.append(server)
    proc, base = server.proc, server.base_url
    ok = httpx.post(f"{base}/v1/completions", json=body(3, stream=False), timeout=10)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    url = f"{base}/v1/completions"
    with httpx.stream("POST", url, json=body(100_000 // 40), timeout=20) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert first.startswith("data: {")
        proc.send_signal(signal.SIGTERM)
        # The listener is still open: /health fails, new requests get the documented 503.
        wait_until_draining(base)
        refused = httpx.post(url, json=body(2, stream=False), timeout=5)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        rest = [ln for ln in lines if ln]
    # Cut at the timeout, not run to its 2,500 tokens: the stream ends in the shutdown error
    # (no wall-clock bound: a loaded machine may stall the test itself for seconds).
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2].removeprefix("data: "))
    assert err["error"]["code"] == "shutting_down" and err["error"]["type"] == "server_error"
    assert proc.wait(15) == 1
    assert "Traceback" not in server.stderr()


def test_drain_that_completes_exits_zero(procs):
    server = start(shutdown_timeout=20, delay=0.02)
    procs.append(server)
    proc, base = server.proc, server.base_url
    with httpx.stream("POST", f"{base}/v1/completions", json=body(60), timeout=20) as r:
        lines = r.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)
        text = "".join(lines)
    assert text.endswith("data: [DONE]") and '"finish_reason":"length"' in text
    assert proc.wait(15) == 0


def test_idle_server_exits_at_once(procs):
    # A shutdown timeout far above the bound: a server that waited for it fails, while a
    # loaded machine's seconds of delay do not.
    server = start(shutdown_timeout=300, delay=0.0)
    procs.append(server)
    proc = server.proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0  # one that waited for its 300 s timeout times out here
