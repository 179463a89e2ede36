"""Load test for `tallow serve`: TTFT, inter-token latency and throughput under concurrency.

    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000 --model NAME \\
        --max-tokens 64 --concurrency 1 8 32

Each level runs `concurrency` streaming completions at once (greedy, ignore_eos so every
stream produces exactly --max-tokens tokens) and reports p50/p99 TTFT, p50/p99 inter-token
latency (gaps between content chunks) and aggregate generated tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass, field

import openai


@dataclass
class StreamResult:
    ttft: float
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


async def one_stream(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: str,
    n: int,
    *,
    extra_body: dict | None = None,
    leave_after_chunks: int | None = None,
) -> StreamResult:
    """One streaming completion, timed. `extra_body` adds fields (default: greedy with
    ignore_eos); with `leave_after_chunks` the client closes the stream after that many
    content chunks, as a user who stops reading (benchmarks/soak.py)."""
    t0 = time.perf_counter()
    last = first = None
    gaps: list[float] = []
    tokens = chunks = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=n,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} if extra_body is None else extra_body,
    )
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices or not chunk.choices[0].text:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            gaps.append(now - last)
        last = now
        chunks += 1
        if leave_after_chunks is not None and chunks >= leave_after_chunks:
            await stream.close()
            break
    return StreamResult(ttft=(first or time.perf_counter()) - t0, gaps=gaps, tokens=tokens)


async def run_level(client: openai.AsyncOpenAI, model: str, conc: int, n: int) -> dict:
    prompts = [f"Request {i}: write a short story about the number {i}." for i in range(conc)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_stream(client, model, p, n) for p in prompts))
    wall = time.perf_counter() - t0
    gaps = [g for r in results for g in r.gaps]
    return {
        "conc": conc,
        "ttft50": percentile([r.ttft for r in results], 50) * 1e3,
        "ttft99": percentile([r.ttft for r in results], 99) * 1e3,
        "itl50": percentile(gaps, 50) * 1e3,
        "itl99": percentile(gaps, 99) * 1e3,
        "tok_s": sum(r.tokens for r in results) / wall,
        "wall": wall,
    }


async def main_async(args: argparse.Namespace) -> None:
    client = openai.AsyncOpenAI(
        base_url=args.base_url.rstrip("/") + "/v1",
        api_key=args.api_key or os.environ.get("TALLOW_API_KEY") or "none",
        max_retries=0,
        timeout=600,
    )
    model = args.model or (await client.models.list()).data[0].id
    await one_stream(client, model, "warm up", 4)  # first-call costs are not load
    print(f"model {model}, {args.max_tokens} tokens per stream")
    head = f"{'conc':>5} {'TTFT p50':>10} {'TTFT p99':>10} {'ITL p50':>9} {'ITL p99':>9} "
    print(head + f"{'tok/s':>8} {'wall s':>7}")
    for conc in args.concurrency:
        r = await run_level(client, model, conc, args.max_tokens)
        print(
            f"{r['conc']:>5} {r['ttft50']:>8.1f}ms {r['ttft99']:>8.1f}ms {r['itl50']:>7.1f}ms "
            f"{r['itl99']:>7.1f}ms {r['tok_s']:>8.1f} {r['wall']:>7.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model name (default: the server's first model)")
    p.add_argument("--api-key", help="default: $TALLOW_API_KEY")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
