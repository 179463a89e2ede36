"""Prefix-cache hit rate through Ray Serve: prefix-aware routing against Serve's default router.

    python benchmarks/scale_out.py ARTIFACT --replicas 2 --threads 1 --prompts 4 --users 8

For each router it starts the application (`tallow.server.ray_app`) on a local Ray, sends
PROMPTS long system prompts x USERS users' questions (USERS at a time, one round per user,
so every prefix is in flight at once), and reads each replica's `tallow_prefix_cache_hit_tokens`
and `tallow_prompt_tokens` from /metrics: the hit rate is their ratio over all replicas. The
replicas start fresh for each router, so their prefix caches start empty.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def counters(base: str, replicas: int) -> dict[str, dict[str, float]]:
    """Each replica's counters; /metrics reaches one replica a time: ask until all answered."""
    seen: dict[str, dict[str, float]] = {}
    for _ in range(200):
        r = httpx.get(f"{base}/metrics", timeout=60)
        found = re.findall(r"^(tallow_\w+)\{[^}]*\} (\S+)$", r.text, re.M)
        seen[r.headers["x-tallow-replica"]] = {k: float(v) for k, v in found}
        if len(seen) == replicas:
            return seen
    raise RuntimeError(f"/metrics answered only from {sorted(seen)}")


async def load(base: str, prompts: int, users: int) -> tuple[dict[int, set[str]], float]:
    systems = [
        f"You are helper {i}. " + f"Policy {i}: be brief and exact. " * 60 for i in range(prompts)
    ]
    where: dict[int, set[str]] = {i: set() for i in range(prompts)}
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:

        async def ask(i: int, user: int) -> None:
            messages = [
                {"role": "system", "content": systems[i]},
                {"role": "user", "content": f"User {user} asks: what is {user} + {i}?"},
            ]
            body = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0}
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            where[i].add(r.headers["x-tallow-replica"])

        for user in range(users):
            await asyncio.gather(*(ask(i, user) for i in range(prompts)))
    return where, time.monotonic() - started


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("artifact")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--users", type=int, default=8)
    args = p.parse_args()

    import logging

    import ray
    from ray import serve

    from tallow.server.ray_app import RayAppConfig, build

    logging.getLogger("httpx").setLevel(logging.WARNING)  # Ray logs every request otherwise
    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        for prefix in (True, False):
            config = RayAppConfig(
                args.artifact,
                model_name="m",
                replicas=args.replicas,
                threads=args.threads,
                prefix_routing=prefix,
            )
            serve.run(build(config), name="bench", route_prefix="/")
            where, took = asyncio.run(load(base, args.prompts, args.users))
            stats = counters(base, args.replicas)
            hits = sum(s["tallow_prefix_cache_hit_tokens_total"] for s in stats.values())
            prompt = sum(s["tallow_prompt_tokens_total"] for s in stats.values())
            spread = [len(r) for r in where.values()]
            name = "prefix-aware" if prefix else "Serve default (power of two)"
            print(
                f"{name:30s} hit rate {hits / prompt:6.1%} "
                f"({hits:.0f}/{prompt:.0f} prompt tokens), replicas per prompt {spread}, "
                f"{took:.1f} s",
                flush=True,
            )
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
