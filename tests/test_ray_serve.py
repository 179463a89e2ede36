"""`tallow serve --replicas 2` on a local Ray with the default model (issue 34): the same
greedy outputs as the single server, requests sharing a prefix kept on one replica, a client
that leaves freeing its pages on its replica, a replica killed mid-stream ending that stream
with an error event while the next requests succeed and Serve replaces it, and SIGTERM
draining as the single server does.

Slow: one Ray start (about 20 s on 2 cores) and two replicas, for the whole module. The
cluster gets its own temporary folder (RAY_TMPDIR), so the test finds its replicas' logs and
never touches another Ray on the machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import MODEL, start_process, start_server

from tallow.server.app import ServerOptions

pytest.importorskip("ray.serve", reason="needs tallow[ray]")
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about rain.", "2 + 2 ="]
HEADER = "x-tallow-replica"


@pytest.fixture(scope="module")
def ray_dir():
    # Short: Ray's Unix sockets live under it (a path longer than ~107 bytes fails).
    path = tempfile.mkdtemp(prefix="tr-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def served(smollm2_artifact, ray_dir):
    env = {**os.environ, "TALLOW_API_KEY": "", "RAY_TMPDIR": str(ray_dir)}
    cmd = [sys.executable, "-m", "tallow.cli.main", "serve", str(smollm2_artifact)]
    flags = ["--port", "0", "--replicas", "2", "--threads", "1", "--served-model-name", MODEL]
    server = start_process([*cmd, *flags], env)
    yield server
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(90)
    except Exception:
        server.proc.kill()
        server.proc.wait(10)


@pytest.fixture(scope="module")
def single(smollm2_artifact):
    server = start_server(smollm2_artifact, ServerOptions(), threads=1)
    yield server
    server.stop()


def chat(base: str, messages: list[dict], max_tokens: int = 12) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def test_greedy_outputs_equal_the_single_servers(served, single):
    for probe in ("/health/live", "/health/ready", "/health"):
        r = httpx.get(served.base_url + probe, timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, probe
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        got, want = chat(served.base_url, messages), chat(single.base_url, messages)
        assert got.status_code == want.status_code == 200, got.text
        assert got.headers[HEADER]
        assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]


def test_requests_sharing_a_prefix_land_on_one_replica(served):
    where: dict[int, set[str]] = {}
    for i in range(3):
        # Long shared system prompts, different per group; a short question varies.
        system = f"You are assistant number {i}. " + f"Rule {i}: answer briefly. " * 40
        for j in range(8):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {j}?"},
            ]
            r = chat(served.base_url, messages, max_tokens=1)
            assert r.status_code == 200, r.text
            where.setdefault(i, set()).add(r.headers[HEADER])
    assert all(len(replicas) == 1 for replicas in where.values()), where
    # The router balances too: a new prefix goes to the replica holding the least.
    assert len(set().union(*where.values())) == 2, where


def stats_by_replica(base: str) -> dict[str, dict[str, float]]:
    """Each replica's gauges and counters. /metrics reaches one replica per request, the less
    busy (the power of two choices): ask until both answered (idle, either is picked)."""
    seen: dict[str, dict[str, float]] = {}
    for _ in range(100):
        r = httpx.get(f"{base}/metrics", timeout=30)
        found = re.findall(r"^(tallow_\w+)\{[^}]*\} (\S+)$", r.text, re.M)
        seen[r.headers[HEADER]] = {name: float(value) for name, value in found}
        if len(seen) == 2:
            return seen
    raise AssertionError(f"/metrics answered only from {list(seen)}")


def start_stream(base: str, client: httpx.Client, max_tokens: int):
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    return client.stream("POST", f"{base}/v1/completions", json=body, timeout=120)


def test_a_client_that_leaves_frees_its_pages_on_its_replica(served):
    before = stats_by_replica(served.base_url)
    with httpx.Client() as client, start_stream(served.base_url, client, 400) as r:
        replica = r.headers[HEADER]
        data = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(40):  # a few pages' worth of tokens
            next(data)
    for _ in range(120):  # the abort reaches the replica's engine within a few steps
        after = stats_by_replica(served.base_url)[replica]
        if after["tallow_num_requests_running"] == 0:
            break
        time.sleep(0.5)
    assert after["tallow_num_requests_running"] == 0
    # Its pages went back, and it stopped long before its 400 tokens.
    assert after["tallow_kv_cache_pages_used"] == before[replica]["tallow_kv_cache_pages_used"]
    generated = after["tallow_generation_tokens_total"]
    assert generated - before[replica]["tallow_generation_tokens_total"] < 300


def replica_pid(ray_dir: Path, replica: str) -> int:
    """The pid a replica printed at start (`ray_app.EngineReplica`), from Ray's worker logs."""
    pattern = re.compile(rf"tallow replica {re.escape(replica)} \(pid (\d+)\)")
    for log in ray_dir.glob("ray/session_*/logs/worker-*.err"):
        m = pattern.search(log.read_text(errors="replace"))
        if m:
            return int(m.group(1))
    raise AssertionError(f"no log names replica {replica}")


def test_a_replica_killed_mid_stream_ends_it_with_an_error_and_the_rest_serve(served, ray_dir):
    events = []
    with httpx.Client() as client, start_stream(served.base_url, client, 2000) as r:
        assert r.status_code == 200
        replica = r.headers[HEADER]
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        events.append(next(lines))
        os.kill(replica_pid(ray_dir, replica), signal.SIGKILL)
        events.extend(lines)  # ends: never a hang
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["code"] == "replica_unavailable", error
    assert len(events) < 2000
    readiness = []
    for prompt in PROMPTS:  # the other replica serves; Serve replaces the dead one
        readiness.append(httpx.get(served.base_url + "/health/ready", timeout=30).status_code)
        r = chat(served.base_url, [{"role": "user", "content": prompt}], max_tokens=4)
        assert r.status_code == 200, r.text
        assert r.headers[HEADER] != replica
    # Ready again once Serve has replaced it (a model load: seconds); not ready meanwhile.
    for _ in range(600):
        readiness.append(httpx.get(served.base_url + "/health/ready", timeout=30).status_code)
        if readiness[-1] == 200 and 503 in readiness:
            break
        time.sleep(0.2)
    assert 503 in readiness and readiness[-1] == 200, readiness
    replicas = stats_by_replica(served.base_url)
    assert replica not in replicas and len(replicas) == 2


def test_sigterm_drains_like_the_single_server(served):
    """Last in the module: it stops the shared server. New requests get 503 while the stream
    in flight runs to its end; the process then exits 0."""
    with httpx.Client() as client, start_stream(served.base_url, client, 200) as r:
        assert r.status_code == 200
        data = (line for line in r.iter_lines() if line.startswith("data: "))
        next(data)
        served.proc.send_signal(signal.SIGTERM)
        for _ in range(200):  # the CLI tells the ingress to drain (no fixed sleep)
            if httpx.get(served.base_url + "/health/ready", timeout=30).status_code == 503:
                break
            time.sleep(0.1)
        assert httpx.get(served.base_url + "/health/live", timeout=30).status_code == 200
        refused = httpx.get(served.base_url + "/v1/models", timeout=30)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        rest = list(data)
    assert rest[-1] == "data: [DONE]"
    assert len(rest) == 200  # every token (199 after the first, one with finish_reason), [DONE]
    assert served.proc.wait(120) == 0
