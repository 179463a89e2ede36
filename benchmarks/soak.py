"""Soak test of `tallow serve`: 64 concurrent clients for an hour (issue 33).

    .venv/bin/python benchmarks/soak.py [--artifact DIR] [--duration 3600] [--streams 64] \\
        [--interval 10] [--warm-up 300] [--out soak.json]

Starts the server as a child process (default: the embedded SmolLM2; prefix cache on) and
runs `--streams` client loops, each sending one request after another: streaming chat and
completions of mixed lengths whose prompts share four long prefixes (the prefix cache's
work), one stream in ten left by its client after a few tokens, embeddings (one request in
ten) and constrained output (one in ten: a JSON schema, a choice or a regex). Every
`--interval` seconds it samples the server's RSS, open descriptors and threads (/proc), the
KV pages in use (/metrics), and the window's requests, errors, p50/p99 time to first token
and p50/p99 request latency; the samples go to `--out` (JSON) and a CSV beside it.

The load comes from the asyncio client of benchmarks/serve_load.py (the official `openai`
client, so every chunk is also parsed as OpenAI's types). Measured side by side on the tiny
model (docs/benchmarks.md), Locust's FastHttpUser spends less CPU per streamed request (2.5
ms against 15 ms), but at what SmolLM2 serves on 2 cores (about 1 request/s for 64 clients)
this client takes 1% of one core; its share is printed with the results.

Pass (computed here): 0 errors (a request that fails, or a stream with an error event; the
clients that leave on purpose are not errors); RSS at the end (median of the last 3 samples)
within 10% (and at least 16 MB) of its post-warm-up level (median of the first 3 samples
after `--warm-up`); descriptors at the end at most 8 above their post-warm-up maximum, and
threads at most 2 above their maximum over the first half of the run after warm-up (pools
of threads grow lazily up to their bounds); p99 time to first token and p99 latency at the
end (median of the last quarter of windows) at most 1.5x (`--p99-factor`) their post-warm-up
level (first quarter); and once the clients stop, no sequence running and no KV page held
beyond what the prefix cache may keep (every page, with --no-prefix-cache).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_server import MODEL, gauge, process_sample, start_serve, stop_serve  # noqa: E402
from serve_load import one_stream, percentile  # noqa: E402

PREFIX_TOPICS = ["a lighthouse keeper", "a train timetable", "a recipe for bread", "a chess game"]


@dataclass
class Done:
    kind: str
    t_end: float
    latency: float
    ttft: float | None = None
    error: str | None = None


@dataclass
class Sample:
    t: float
    rss_mb: float
    fds: int
    threads: int
    kv_pages_used: int
    requests: int
    errors: int
    left: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    client_cpu_pct: float


@dataclass
class Mix:
    """What each client sends next; lengths scale with the model's context window."""

    window: int
    rng: random.Random
    prefixes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        words = max(16, min(200, self.window // 8))
        for topic in PREFIX_TOPICS:
            text = f"You are a helpful assistant who knows all about {topic}. " * 40
            self.prefixes.append(" ".join(text.split()[:words]))

    def max_tokens(self) -> int:
        return self.rng.choice([8, 32, max(8, min(96, self.window // 4))])

    def prompt(self) -> str:
        return f"{self.rng.choice(self.prefixes)}\nQuestion {self.rng.randrange(10**6)}: why?"


async def one_request(client: openai.AsyncOpenAI, mix: Mix, leave_share: float) -> Done:
    rng = mix.rng
    roll = rng.random()
    t0 = time.perf_counter()
    kind = "stream"
    try:
        if roll < 0.1:
            kind = "embeddings"
            inputs = [mix.prompt() for _ in range(rng.randint(1, 8))]
            await client.embeddings.create(model=MODEL, input=inputs)
            return Done(kind, time.monotonic(), time.perf_counter() - t0)
        if roll < 0.2:
            kind = "constrained"
            extra = rng.choice(
                [
                    {"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}}}},
                    {"guided_choice": ["yes", "no", "maybe"]},
                    {"guided_regex": "[a-z]{1,12}"},
                ]
            )
            await client.completions.create(
                model=MODEL, prompt=mix.prompt(), max_tokens=16, extra_body=extra
            )
            return Done(kind, time.monotonic(), time.perf_counter() - t0)
        leave = rng.random() < leave_share
        kind = "left" if leave else "stream"
        result = await one_stream(
            client,
            MODEL,
            mix.prompt(),
            mix.max_tokens(),
            extra_body={"ignore_eos": rng.random() < 0.5},
            leave_after_chunks=rng.randint(1, 4) if leave else None,
        )
        return Done(kind, time.monotonic(), time.perf_counter() - t0, ttft=result.ttft)
    except (openai.OpenAIError, httpx.HTTPError) as e:
        return Done(kind, time.monotonic(), time.perf_counter() - t0, error=f"{e}"[:200])


async def client_loop(
    client: openai.AsyncOpenAI, mix: Mix, leave_share: float, done: list, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        done.append(await one_request(client, mix, leave_share))


def window_sample(t: float, pid: int, kv: int, window: list[Done], cpu_pct: float) -> Sample:
    proc = process_sample(pid)
    ttfts = [d.ttft for d in window if d.ttft is not None and d.error is None]
    lats = [d.latency for d in window if d.error is None and d.kind != "left"]
    return Sample(
        t=round(t, 1),
        rss_mb=round(proc.rss_mb, 1),
        fds=proc.fds,
        threads=proc.threads,
        kv_pages_used=kv,
        requests=len(window),
        errors=sum(d.error is not None for d in window),
        left=sum(d.kind == "left" for d in window),
        ttft_p50_ms=round(percentile(ttfts, 50) * 1e3, 1),
        ttft_p99_ms=round(percentile(ttfts, 99) * 1e3, 1),
        latency_p50_ms=round(percentile(lats, 50) * 1e3, 1),
        latency_p99_ms=round(percentile(lats, 99) * 1e3, 1),
        client_cpu_pct=round(cpu_pct, 1),
    )


async def run(args: argparse.Namespace) -> dict:
    serve_args = ["--no-prefix-cache"] if args.no_prefix_cache else []
    server = await asyncio.to_thread(start_serve, args.artifact, *serve_args)
    pid = server.proc.pid
    samples: list[Sample] = []
    done: list[Done] = []
    stop = asyncio.Event()
    http = httpx.AsyncClient(base_url=server.base_url, timeout=30)
    client = openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600
    )
    try:
        window = (await http.get("/v1/models")).json()["data"][0]["max_model_len"]
        rng = random.Random(args.seed)
        loops = [
            asyncio.create_task(
                client_loop(client, Mix(window, random.Random(rng.random())), 0.1, done, stop)
            )
            for _ in range(args.streams)
        ]
        t0 = time.monotonic()
        seen, cpu0, wall0 = 0, time.process_time(), time.monotonic()
        while time.monotonic() - t0 < args.duration:
            await asyncio.sleep(args.interval)
            kv = int(gauge((await http.get("/metrics")).text, "tallow_kv_cache_pages_used"))
            now = time.monotonic()
            cpu = 100 * (time.process_time() - cpu0) / (now - wall0)
            cpu0, wall0 = time.process_time(), now
            new, seen = done[seen:], len(done)
            samples.append(window_sample(now - t0, pid, kv, new, cpu))
            print(json.dumps(asdict(samples[-1])), file=sys.stderr, flush=True)
        stop.set()
        await asyncio.gather(*loops)  # each client finishes the request it is in
        end = await settle(http)
    finally:
        stop.set()
        await client.close()
        await http.aclose()
        stderr = server.stderr()
        code = stop_serve(server)
    page_size = int(m.group(1)) if (m := re.search(r"pages x (\d+) tokens", stderr)) else 16
    cache_pages = 0 if args.no_prefix_cache else -(-args.prefix_cache_max_tokens // page_size)
    return judge(samples, done, end, cache_pages, args.warm_up, code, args.p99_factor)


async def settle(http: httpx.AsyncClient, wait_s: float = 30.0) -> dict:
    """Running sequences and KV pages in use once the clients stopped (waiting for aborted
    streams to be reaped)."""
    deadline = time.monotonic() + wait_s
    while True:
        text = (await http.get("/metrics")).text
        running = int(gauge(text, "tallow_num_requests_running"))
        kv = int(gauge(text, "tallow_kv_cache_pages_used"))
        if running == 0 or time.monotonic() > deadline:
            return {"running": running, "kv_pages_used": kv}
        await asyncio.sleep(0.5)


def judge(
    samples: list[Sample],
    done: list[Done],
    end: dict,
    cache_pages: int,
    warm_up: float,
    code: int | None,
    p99_factor: float = 1.5,
) -> dict:
    after = [s for s in samples if s.t > warm_up] or samples
    first, last = after[:3], after[-3:]
    quarter = max(1, len(after) // 4)
    rss0, rss1 = (
        statistics.median(s.rss_mb for s in first),
        statistics.median(s.rss_mb for s in last),
    )
    fds0, fds1 = max(s.fds for s in first), max(s.fds for s in last)
    # Threads come and go in bounded pools (AnyIO's for sync routes, the request-preparation
    # and grammar threads, asyncio's executor), growing lazily: a leak shows as growth past
    # what the first half of the run after warm-up reached, not past its first samples.
    thr0 = max(s.threads for s in after[: max(3, len(after) // 2)])
    thr1 = max(s.threads for s in last)

    def level(xs: list[Sample], name: str) -> float:
        values = [getattr(s, name) for s in xs if not math.isnan(getattr(s, name))]
        return statistics.median(values) if values else math.nan  # nan: a window with no answer

    errors = [d for d in done if d.error is not None]
    checks = {
        "0 errors": not errors,
        "RSS flat": rss1 <= rss0 + max(0.10 * rss0, 16.0),
        "descriptors flat": fds1 <= fds0 + 8,
        "threads flat": thr1 <= thr0 + 2,
        "p99 TTFT stable": level(after[-quarter:], "ttft_p99_ms")
        <= p99_factor * level(after[:quarter], "ttft_p99_ms"),
        "p99 latency stable": level(after[-quarter:], "latency_p99_ms")
        <= p99_factor * level(after[:quarter], "latency_p99_ms"),
        "no sequence left running": end["running"] == 0,
        "KV pages back": end["kv_pages_used"] <= cache_pages,
    }
    return {
        "passed": all(checks.values()),
        "checks": checks,
        "requests": len(done),
        "by_kind": {k: sum(d.kind == k for d in done) for k in sorted({d.kind for d in done})},
        "errors": [asdict(d) for d in errors[:20]],
        "rss_mb": {"warm": rss0, "peak": max(s.rss_mb for s in samples), "end": rss1},
        "fds": {"warm": fds0, "peak": max(s.fds for s in samples), "end": fds1},
        "threads": {"warm": thr0, "peak": max(s.threads for s in samples), "end": thr1},
        "ttft_p99_ms": {
            "warm": level(after[:quarter], "ttft_p99_ms"),
            "end": level(after[-quarter:], "ttft_p99_ms"),
        },
        "latency_p99_ms": {
            "warm": level(after[:quarter], "latency_p99_ms"),
            "end": level(after[-quarter:], "latency_p99_ms"),
        },
        "end": end,
        "cache_pages_allowed": cache_pages,
        "server_exit_status": code,
        "client_cpu_pct": statistics.median(s.client_cpu_pct for s in samples),
        "samples": [asdict(s) for s in samples],
    }


def render(result: dict) -> str:
    lines = [f"{result['requests']} requests {result['by_kind']}"]
    head = f"{'':<16}{'warm':>10}{'peak':>10}{'end':>10}"
    lines.append(head)
    for name in ("rss_mb", "fds", "threads"):
        r = result[name]
        lines.append(f"{name:<16}{r['warm']:>10}{r['peak']:>10}{r['end']:>10}")
    for name in ("ttft_p99_ms", "latency_p99_ms"):
        r = result[name]
        lines.append(f"{name:<16}{r['warm']:>10}{'':>10}{r['end']:>10}")
    lines.append(
        f"after the clients stopped: {result['end']} "
        f"(prefix cache may hold {result['cache_pages_allowed']} pages)"
    )
    lines.append(f"client CPU (median of windows): {result['client_cpu_pct']}% of one core")
    failed = [k for k, ok in result["checks"].items() if not ok]
    lines.append("PASS" if not failed else "FAIL: " + ", ".join(failed))
    return "\n".join(lines)


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(result["samples"][0]))
        w.writeheader()
        w.writerows(result["samples"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, help="default: the embedded SmolLM2 (artifacts/)")
    p.add_argument("--duration", type=float, default=3600.0, help="seconds (3600)")
    p.add_argument("--streams", type=int, default=64, help="concurrent clients (64)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples (10)")
    p.add_argument("--warm-up", type=float, help="seconds before the baseline (10%%, >= 60)")
    p.add_argument(
        "--p99-factor",
        type=float,
        default=1.5,
        help="p99s at the end may be this many times their post-warm-up level (1.5)",
    )
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--prefix-cache-max-tokens", type=int, default=8192, help="the server's")
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--out", type=Path, default=Path("soak.json"), help="JSON (and .csv)")
    args = p.parse_args(argv)
    if args.warm_up is None:
        args.warm_up = max(60.0, 0.1 * args.duration)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print(render(result))  # first: an hour's verdict must not depend on the file write
    write(result, args.out)
    print(f"samples in {args.out} and {args.out.with_suffix('.csv')}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
