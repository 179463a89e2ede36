"""`tallow serve` as a child process for the fuzz campaign and the soak, and what they watch in
it: /health latency, RSS, open descriptors, threads and the KV pages gauge of /metrics.

The process is started with tests/server_helpers.py's `start_process` (port 0, its URL read
from the `serving NAME on URL` line), so the harnesses and the tests start servers one way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from server_helpers import ServerProcess, start_process  # noqa: E402

# What `tallow serve` compiles and serves when given no artifact (cli/main.py).
DEFAULT_ARTIFACT = ROOT / "artifacts" / "smollm2-135m-instruct-q4_1-cpu"
MODEL = "fuzz"  # --served-model-name


def start_serve(artifact: Path | None, *args: str) -> ServerProcess:
    """`tallow serve [ARTIFACT] --port 0 --served-model-name fuzz ARGS...`; without an artifact
    the embedded default model, compiled into artifacts/ on first use (run from the repository
    root, where `tallow serve` looks for it)."""
    cmd = [sys.executable, "-m", "tallow.cli.main", "serve"]
    cmd += [str(artifact)] if artifact is not None else []
    cmd += ["--port", "0", "--served-model-name", MODEL, *args]
    env = {**os.environ, "TALLOW_API_KEY": ""}
    cwd = os.getcwd()
    os.chdir(ROOT)  # the default artifact's path is relative to the repository root
    try:
        return start_process(cmd, env)
    finally:
        os.chdir(cwd)


def stop_serve(server: ServerProcess) -> int:
    """SIGTERM and wait (the drain is short: the harness has stopped sending); the exit
    status, negative for a signal."""
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(60)
        except Exception:  # noqa: BLE001 - a stuck drain: kill it
            server.proc.kill()
            server.proc.wait(10)
    return server.proc.returncode


@dataclass
class ProcessSample:
    rss_mb: float
    fds: int
    threads: int


def process_sample(pid: int) -> ProcessSample:
    """RSS, open descriptors and threads of `pid`, from /proc (Linux)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return ProcessSample(rss_kb / 1024, fds, threads)


def gauge(metrics_text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics_text, re.M)
    if m is None:
        raise KeyError(f"{name} not in /metrics")
    return float(m.group(1))


async def kv_pages_used(client: httpx.AsyncClient) -> int:
    r = await client.get("/metrics", timeout=30)
    return int(gauge(r.text, "tallow_kv_cache_pages_used"))


@dataclass
class HealthProbe:
    """GET /health every `interval` seconds; the worst latency, and the times it passed
    `stall_s` (each with when it started, to match against what was in flight then)."""

    interval: float = 0.25
    stall_s: float = 1.0
    worst_s: float = 0.0
    probes: int = 0
    failures: int = 0  # no answer, or not 200
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (start, latency)
    slowest: list[tuple[float, float]] = field(default_factory=list)  # (latency, start), top 5

    async def run(self, base_url: Callable[[], str], stop: asyncio.Event) -> None:
        """Until `stop`; `base_url()` is asked each time (a restarted server has a new port)."""
        async with httpx.AsyncClient() as client:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    r = await client.get(base_url() + "/health", timeout=30)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                dt = time.monotonic() - t0
                self.probes += 1
                self.failures += not ok
                self.worst_s = max(self.worst_s, dt)
                if dt > self.stall_s:
                    self.stalls.append((t0, dt))
                self.slowest = sorted([*self.slowest, (dt, t0)], reverse=True)[:5]
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, self.interval - dt))
