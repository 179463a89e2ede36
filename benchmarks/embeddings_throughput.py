"""Embeddings per second on one artifact: 64 short texts one request at a time (batch 1) vs
all submitted at once (the scheduler batches them, up to `--max-num-seqs` per step).

    .venv/bin/python benchmarks/embeddings_throughput.py ARTIFACT [--texts 64] [--rounds 3]

Any artifact compiled with this tallow works (`--task generate` or `--task embed`). The texts
are short sentences (about 8 to 20 tokens). Each mode runs `--rounds` times, interleaved, and
the table shows the median embeddings/s and its spread (this machine's shared cores vary).
"""

from __future__ import annotations

import argparse
import statistics
import time

from tallow.runtime.engine_factory import EngineOptions, build_engine

SENTENCE = (
    "the quick brown fox jumps over a lazy dog while paris stays the capital of france and "
    "numbers like 42 or 1234 sit beside small code such as def f x return x times two"
)
WORDS = SENTENCE.split()


def texts(n: int) -> list[str]:
    return [" ".join(WORDS[(7 * i) % 20 : (7 * i) % 20 + 6 + i % 8]) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-mem", type=float, default=256, help="MB (default 256)")
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()

    options = EngineOptions(
        max_num_seqs=args.max_num_seqs, kv_cache_mem_mb=args.kv_cache_mem, threads=args.threads
    )
    engine = build_engine(args.artifact, options)
    prompts = [engine.model.encode_text(t) for t in texts(args.texts)]
    tokens = sum(len(p) for p in prompts)
    engine.embed_sync(prompts[:4])  # warm-up
    rates: dict[str, list[float]] = {"batch 1": [], "batched": []}
    for _ in range(args.rounds):
        t = time.perf_counter()
        for p in prompts:
            engine.embed_sync([p])
        rates["batch 1"].append(len(prompts) / (time.perf_counter() - t))
        t = time.perf_counter()
        engine.embed_sync(prompts)
        rates["batched"].append(len(prompts) / (time.perf_counter() - t))
    print(f"{args.artifact}: {len(prompts)} texts, {tokens} tokens, {args.rounds} rounds")
    print(f"{'mode':<10}{'emb/s':>10}{'tok/s':>10}  spread (emb/s)")
    for mode, r in rates.items():
        med = statistics.median(r)
        spread = f"{min(r):.1f}-{max(r):.1f}"
        print(f"{mode:<10}{med:>10.1f}{med * tokens / len(prompts):>10.0f}  {spread}")
    base = statistics.median(rates["batch 1"])
    print(f"batched / batch 1: {statistics.median(rates['batched']) / base:.2f}x")


if __name__ == "__main__":
    main()
