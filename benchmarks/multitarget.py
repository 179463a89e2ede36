"""Figures for one artifact with several libraries (issue 25).

    python benchmarks/multitarget.py compile --model DIR_OR_GGUF --out /tmp/mt
    python benchmarks/multitarget.py decode ARTIFACT [--rounds 5] [--tokens 64] [--threads N] \\
        [--batch 1]

`compile`: the wall and CPU time of one three-target compile (cpu x86-64-v3, cuda sm_80 +
sm_90, metal) against three single-target compiles of the same model, each a fresh
`tallow compile` process, and the size of every file of the three-target artifact.
`decode`: greedy decode tok/s of each CPU library of ARTIFACT (e.g. `--cpu native --cpu
x86-64-v3`), loaded side by side and measured in interleaved rounds (the median is printed):
the price of a portable library on this machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

THREE = ["--target", "cpu", "--cpu", "x86-64-v3", "--target", "cuda", "-sm", "80", "-sm", "90"]
THREE += ["--target", "metal"]
SINGLES = {
    "cpu x86-64-v3": ["--target", "cpu", "--cpu", "x86-64-v3"],
    "cuda sm_80 sm_90": ["--target", "cuda", "-sm", "80", "-sm", "90"],
    "metal": ["--target", "metal"],
}


def _compile(model: str, out: Path, name: str, targets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "tallow.cli.main", "compile", "--model", model, "--quiet"]
    cmd += ["--output", str(out), "--name", name, "--overwrite", *targets]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def run_compile(model: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    result = {"three_targets": _compile(model, out, "three", THREE), "single": {}}
    for label, targets in SINGLES.items():
        result["single"][label] = _compile(model, out, label.replace(" ", "-"), targets)
    for key in ("wall_s", "cpu_s"):
        result[f"singles_total_{key}"] = round(sum(r[key] for r in result["single"].values()), 1)
    art = out / "three"
    files = sorted(p for p in art.rglob("*") if p.is_file())
    result["sizes_bytes"] = {str(p.relative_to(art)): p.stat().st_size for p in files}
    return result


def run_decode(artifact: Path, rounds: int, tokens: int, threads: int | None, batch: int) -> dict:
    from tallow.runtime.library_select import LibraryChoice
    from tallow.runtime.manifest import Manifest
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    manifest = Manifest.read(artifact)
    runners = {}
    for lib in manifest.libraries:
        if lib.device == "cpu":
            choice = LibraryChoice(lib, "cpu", 0, "benchmark")
            kv = KVCacheConfig(batch, 1024 * batch, 256)
            runners[lib.target] = TVMModelRunner(artifact, choice, kv, threads=threads)
    prompt = runners[next(iter(runners))].tokenizer.tokenizer.encode("The capital of France is")
    speeds: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(rounds):
        for name, runner in runners.items():  # interleaved: the machine's noise hits all
            seqs = [r * batch + i for i in range(batch)]
            for seq in seqs:
                runner.add_sequence(seq)
            logits = runner.forward([(seq, prompt.ids) for seq in seqs])
            next_ids = [int(row.argmax()) for row in logits]
            t = time.perf_counter()
            for _ in range(tokens):
                logits = runner.forward([(s, [tok]) for s, tok in zip(seqs, next_ids, strict=True)])
                next_ids = [int(row.argmax()) for row in logits]
            speeds[name].append(batch * tokens / (time.perf_counter() - t))
            for seq in seqs:
                runner.remove_sequence(seq)
    return {
        name: {"median_tok_s": round(statistics.median(v), 1), "rounds": [round(x) for x in v]}
        for name, v in speeds.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--model", required=True)
    c.add_argument("--out", type=Path, required=True)
    d = sub.add_parser("decode")
    d.add_argument("artifact", type=Path)
    d.add_argument("--rounds", type=int, default=5)
    d.add_argument("--tokens", type=int, default=64)
    d.add_argument("--threads", type=int, help="CPU threads (default: every usable CPU)")
    d.add_argument("--batch", type=int, default=1, help="sequences decoded together (1)")
    args = ap.parse_args()
    if args.cmd == "compile":
        print(json.dumps(run_compile(args.model, args.out), indent=1))
    else:
        print(
            json.dumps(
                run_decode(args.artifact, args.rounds, args.tokens, args.threads, args.batch),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
