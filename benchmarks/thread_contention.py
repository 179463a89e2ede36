"""Decode speed of `tallow generate` on a shared machine: TVM's thread pool at several thread
counts and pool settings, with and without busy processes on every core.

    .venv/bin/python benchmarks/thread_contention.py ARTIFACT [--rounds 3] [--hogs 2]

Each configuration is a `tallow generate ARTIFACT --threads N` (or the default) in its own
process, 128 greedy tokens; its decode tok/s is read from the stderr summary. A configuration
sets environment variables for TVM's pool as well: `TVM_THREAD_POOL_SPIN_COUNT` (how long a
worker spins before it sleeps; TVM's default 300,000) and `TVM_BIND_THREADS` (0: workers
are not pinned to cores). The hogs are `--hogs` processes spinning in a Python loop (what
another user's job looks like to the scheduler), started before a round and stopped after
it. Rounds interleave the configurations, quiet and loaded alike, and the table gives the
median and the range of each.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = "Write a short story about a lighthouse keeper."

# name -> (--threads, extra environment); None: tallow's default
CONFIGS: dict[str, tuple[int | None, dict[str, str]]] = {
    "threads 1": (1, {}),
    "threads 2": (2, {}),
    "default": (None, {}),
    "threads 2, no spin": (2, {"TVM_THREAD_POOL_SPIN_COUNT": "0"}),
    "threads 2, spin 1000": (2, {"TVM_THREAD_POOL_SPIN_COUNT": "1000"}),
    "threads 2, spin 10000": (2, {"TVM_THREAD_POOL_SPIN_COUNT": "10000"}),
    "threads 2, unpinned": (2, {"TVM_BIND_THREADS": "0"}),
    "threads 2, no spin, unpinned": (
        2,
        {"TVM_THREAD_POOL_SPIN_COUNT": "0", "TVM_BIND_THREADS": "0"},
    ),
}


def _spin() -> None:
    while True:
        pass


def decode_tok_s(artifact: Path, threads: int | None, env: dict[str, str], tokens: int) -> float:
    cmd = [sys.executable, "-m", "tallow.cli.main", "generate", str(artifact), "--prompt", PROMPT]
    cmd += ["--max-tokens", str(tokens), "--ignore-eos", "--temperature", "0"]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    clean = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    proc = subprocess.run(cmd, env={**clean, **env}, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    m = re.search(r"generated \d+ tokens, ([\d.]+) tok/s", proc.stderr)
    if m is None:
        raise RuntimeError(f"no decode rate in: {proc.stderr[-500:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--only", nargs="*", help="configuration names to run (default: all)")
    args = ap.parse_args()
    configs = {k: v for k, v in CONFIGS.items() if not args.only or k in args.only}
    results: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.rounds):
        for loaded in (False, True):
            hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.hogs)]
            if loaded:
                for h in hogs:
                    h.start()
            try:
                for name, (threads, env) in configs.items():
                    rate = decode_tok_s(args.artifact, threads, env, args.tokens)
                    results.setdefault((name, loaded), []).append(rate)
                    state = f"{args.hogs} hogs" if loaded else "quiet"
                    print(f"round {r + 1} {state:8s} {name:30s} {rate:7.1f} tok/s", flush=True)
            finally:
                for h in hogs if loaded else []:
                    h.terminate()
                    h.join()
    print(f"\ndecode tok/s, median (min-max) of {args.rounds} rounds; {os.cpu_count()} CPUs")
    print(f"| configuration | quiet | {args.hogs} busy processes |\n|---|---:|---:|")
    for name in configs:
        cells = []
        for loaded in (False, True):
            v = results[(name, loaded)]
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})")
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
