"""Where a 500-token prefill's CPU time goes, per kernel, on a GGUF file.

    .venv/bin/python benchmarks/prefill_profile.py --gguf FILE [--artifact DIR] [--rounds 5]
        [--llamacpp] [--threads 2]

Compiles the file (or reuses `--artifact`), times `batch_prefill` of a fresh 500-token prompt
per round (a new sequence each time: the prefix cache plays no part here), best and median,
then runs one prefill through TVM's profiling VM and prints the kernels' total ms, grouped by
name, largest first (the profiler's own overhead stretches the total a little);
`--llamacpp` adds llama.cpp's prefill of the same prompts, interleaved with tallow's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

PROMPT_TOKENS = 500


def compile_artifact(gguf: Path, out: Path) -> Path:
    from tallow.compiler.pipeline import CompileOptions, compile_model

    t = time.perf_counter()
    art = compile_model(CompileOptions(model=str(gguf), output=out, quiet=True))
    print(f"compile: {time.perf_counter() - t:.0f} s")
    return Path(art)


def kernel_table(runner, prompt: list[int], top: int) -> None:
    """One prefill with the VM's instrument hook timing every call: wall ms and the calling
    thread's CPU ms per kernel name. With `--threads 1` the kernels run on that thread, so
    its CPU time is the kernel's own, whatever else the machine runs (wall time is not)."""
    seq = 10_000
    totals: dict[str, list[float]] = {}
    started: list[tuple[float, float]] = []

    def instrument(func, name, before, ret, *args):
        if before:
            started.append((time.perf_counter(), time.thread_time()))
        else:
            wall, cpu = started.pop()
            entry = totals.setdefault(str(name), [0.0, 0.0, 0])
            entry[0] += (time.perf_counter() - wall) * 1000
            entry[1] += (time.thread_time() - cpu) * 1000
            entry[2] += 1
        return 0

    runner.vm.set_instrument(instrument)
    runner.add_sequence(seq)
    t = time.perf_counter()
    try:
        runner.forward([(seq, prompt)])
    finally:
        runner.remove_sequence(seq)
    wall = (time.perf_counter() - t) * 1000
    cpu = sum(v[1] for v in totals.values())
    print(f"instrumented prefill: {wall:.0f} ms wall, {cpu:.0f} ms CPU (this thread) in calls")
    print(f"{'wall ms':>9} {'cpu ms':>9} {'calls':>5}  kernel")
    for name, (ms, cpu_ms, count) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{ms:9.2f} {cpu_ms:9.2f} {count:5d}  {name}")


def side_by_side(runner, gguf: Path, threads: int, rounds: int) -> None:
    """Prefill of a fresh 500-token prompt, tallow and llama.cpp interleaved (llama-cpp-python,
    same thread count, its KV cache cleared each round): best of `rounds` each, and the ratio."""
    from llama_cpp import Llama

    llm = Llama(str(gguf), n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)
    rng = np.random.default_rng(1)
    ours, theirs, ours_cpu, theirs_cpu = [], [], [], []
    for i in range(rounds):
        prompt = [int(t) for t in rng.integers(100, 20000, size=PROMPT_TOKENS)]
        seq = 20_000 + i
        runner.add_sequence(seq)
        t, c = time.perf_counter(), time.process_time()
        runner.forward([(seq, prompt)])
        ours.append(time.perf_counter() - t)
        ours_cpu.append(time.process_time() - c)
        runner.remove_sequence(seq)
        llm.reset()
        t, c = time.perf_counter(), time.process_time()
        llm.eval(prompt)
        theirs.append(time.perf_counter() - t)
        theirs_cpu.append(time.process_time() - c)
    a, b = PROMPT_TOKENS / min(ours), PROMPT_TOKENS / min(theirs)
    print(
        f"side by side, {threads} threads, best of {rounds}: tallow {a:.0f} tok/s, "
        f"llama.cpp {b:.0f} tok/s, ratio {a / b:.2f}; process CPU time best "
        f"{min(ours_cpu) * 1000:.0f} ms against {min(theirs_cpu) * 1000:.0f} ms"
    )


def main() -> None:
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--artifact", type=Path, help="a compiled folder (compiled there if absent)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp on --gguf, interleaved")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    art = args.artifact
    if art is None or not any(art.glob("**/manifest.yaml")):
        if args.gguf is None:
            raise SystemExit("give --gguf (and --artifact to keep the compiled folder)")
        art = compile_artifact(args.gguf, art or Path("prefill_profile_artifact"))
    if not (art / "manifest.yaml").exists():  # compile_model writes a folder inside
        (art,) = [p for p in art.iterdir() if (p / "manifest.yaml").exists()]
    runner = TVMModelRunner(art, kv=KVCacheConfig(1, 4096, 512), threads=args.threads)
    rng = np.random.default_rng(0)
    times, cpu = [], []
    for i in range(args.rounds):
        prompt = [int(t) for t in rng.integers(100, 20000, size=PROMPT_TOKENS)]
        runner.add_sequence(i)
        t, c = time.perf_counter(), time.process_time()
        runner.forward([(i, prompt)])
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        runner.remove_sequence(i)
    best, med = min(times), statistics.median(times)
    print(
        f"prefill {PROMPT_TOKENS} tokens, {args.threads} threads: best {best * 1000:.0f} ms "
        f"({PROMPT_TOKENS / best:.0f} tok/s), median {med * 1000:.0f} ms; "
        f"process CPU time best {min(cpu) * 1000:.0f} ms (a loaded machine stretches wall time)"
    )
    if args.llamacpp:
        side_by_side(runner, args.gguf, args.threads, args.rounds)
    if not args.no_profile:
        prompt = [int(t) for t in rng.integers(100, 20000, size=PROMPT_TOKENS)]
        kernel_table(runner, prompt, args.top)


if __name__ == "__main__":
    main()
