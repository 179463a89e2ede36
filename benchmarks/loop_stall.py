"""How long one heavy request holds up everyone else on a live `tallow serve` (issue 33).

    python benchmarks/loop_stall.py --base-url http://127.0.0.1:8000 --model NAME

For each heavy request below, a greedy stream of 400 tokens is already running and `/health` is
probed every 50 ms from another connection; the table shows the heavy request's status and
time, the worst `/health` latency while it ran, and the longest gap between the stream's
events in the same window (what a user watching another answer sees). A server that prepares
requests on its event loop shows seconds in both; one that prepares them on worker threads
shows the probe's own tens of milliseconds.

- `choice-60k`: a chat request with a 60,000-option `guided_choice` (1.3 MB of options).
- `tokenize-3.6MB`: a 3.6 MB prompt to `/tokenize`.
- `chat-3.6MB`: a 3.6 MB chat message, refused as too long for the context window.
- `embed-2048`: 2,048 short inputs to `/v1/embeddings`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

WORDS = ["capital", "river", "mountain", "the", "of", "a", "city", "green", "7", "Paris"]


def heavy_requests(model: str) -> dict[str, tuple[str, dict]]:
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(600_000))[:3_600_000]
    chat = [{"role": "user", "content": "Pick one."}]
    return {
        "choice-60k": (
            "/v1/chat/completions",
            {
                "model": model,
                "messages": chat,
                "max_tokens": 16,
                "guided_choice": [f"option number {i}" for i in range(60_000)],
            },
        ),
        "tokenize-3.6MB": ("/tokenize", {"model": model, "prompt": text}),
        "chat-3.6MB": (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4},
        ),
        "embed-2048": (
            "/v1/embeddings",
            {"model": model, "input": [f"sentence {i} about the river" for i in range(2048)]},
        ),
    }


async def stream_gaps(client: httpx.AsyncClient, model: str, gaps: list[tuple[float, float]]):
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    last = None
    async with client.stream("POST", "/v1/completions", json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            now = time.perf_counter()
            if line.startswith("data: "):
                if last is not None:
                    gaps.append((now, now - last))
                last = now


async def probe(client: httpx.AsyncClient, stop: asyncio.Event, out: list[tuple[float, float]]):
    while not stop.is_set():
        t0 = time.perf_counter()
        await client.get("/health", timeout=600)
        out.append((t0, time.perf_counter() - t0))
        await asyncio.sleep(0.05)


async def measure(base: str, model: str, name: str, route: str, body: dict) -> str:
    async with httpx.AsyncClient(base_url=base) as c1, httpx.AsyncClient(base_url=base) as c2:
        gaps: list[tuple[float, float]] = []
        health: list[tuple[float, float]] = []
        stop = asyncio.Event()
        streaming = asyncio.create_task(stream_gaps(c1, model, gaps))
        while not gaps:  # the stream is producing
            await asyncio.sleep(0.05)
        probing = asyncio.create_task(probe(c2, stop, health))
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        async with httpx.AsyncClient(base_url=base) as c3:
            r = await c3.post(route, json=body, timeout=600)
        t1 = time.perf_counter()
        stop.set()
        await probing
        streaming.cancel()
        worst_health = max((d for t, d in health if t0 <= t + d and t <= t1), default=0.0)
        worst_gap = max((d for t, d in gaps if t0 <= t <= t1 + 0.5), default=float("nan"))
        cells = [name, r.status_code, f"{t1 - t0:.2f}", f"{worst_health:.3f}", f"{worst_gap:.3f}"]
        return "| " + " | ".join(map(str, cells)) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--only", nargs="*", help="names of the heavy requests to send")
    args = ap.parse_args()
    print("| request | status | its time, s | worst /health, s | longest stream gap, s |")
    print("|---|---|---|---|---|")
    for name, (route, body) in heavy_requests(args.model).items():
        if args.only and name not in args.only:
            continue
        print(asyncio.run(measure(args.base_url, args.model, name, route, body)), flush=True)


if __name__ == "__main__":
    main()
