"""CPU decode and prefill speed of tallow and llama.cpp side by side, on the same GGUF files.

    .venv/bin/pip install llama-cpp-python==0.3.36      # builds llama.cpp (~10 min, 2 cores)
    .venv/bin/python benchmarks/cpu_vs_llamacpp.py [--gguf FILE] [--quant q4k] [--threads 2]
    .venv/bin/python benchmarks/cpu_vs_llamacpp.py --gguf gemma3-270m   # the installed wheels
    .venv/bin/python benchmarks/cpu_vs_llamacpp.py --shape all [--rounds 3] \\
        [--artifact-dir /work/shapes/artifacts]

llama.cpp's side imports `llama_cpp` from wherever Python finds it first: to compare with an
AVX2-only build of it (what an AVX2 CPU runs) on a machine with AVX-512, install one with
`CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF ..." pip install --target DIR`
(the whole line: docs/benchmarks.md) and run with `PYTHONPATH=DIR`; compile tallow's side
`--cpu x86-64-v3` into `--artifact-dir` first.

`--shape NAME` (repeatable; `all`: every name of bench_files.SHAPE_NAMES, the random Q4_K_M
stand-ins of real shapes plus the real Gemma 3 270M and SmolLM2 Q4_1 files) and `--gguf FILE`
add files; with neither, the embedded SmolLM2. Each file is compiled once (kept in
`--artifact-dir` to reuse between runs) and loaded once by each side; then `--rounds` rounds
run tallow and llama.cpp alternately on every file, each round with a new random prompt
(tallow's prefix cache would answer a repeated one; the runner used here has none, but the
rule keeps the sides comparable to `tallow serve`). A round is a prefill of the 500-token
prompt, then 128 greedy decode steps after it. The table shows each side's median tok/s and
the ratio tallow / llama.cpp (>1: tallow is faster), with the load average before and after:
the machine is shared. `--quant` makes tallow requantize (llama.cpp keeps the file's types).

Each side runs in a process of its own (`SideProcess`), loaded once, and the parent waits
`--settle` seconds between turns. In one process the two runtimes slowed each other: after a
call, TVM's and llama.cpp's worker threads keep spinning for a while, and the other side's
threads then share the cores with them. Measured on this 2-core machine (2026-12-01): llama.cpp
ran the Qwen2.5-0.5B shape's prefill at 140 tok/s next to tallow and 172-181 tok/s alone.
`--same-process` keeps the old arrangement for comparison.

Bandwidth (`bandwidth.py`): before the rounds and after every turn the parent times a
`--threads`-thread numpy read of 1 GiB (the stream figure; the best pass of the run is the
ceiling). Each file's weight bytes per decode step (every tensor in its stored type, one row
of an untied embedding) times decode tok/s gives the GB/s each side streams its weights at,
and the table shows it with its share of the stream figure. At 3B-8B those shares say how
close batch-1 decode is to the memory limit; at 0.5B the weights partly fit in cache and a
share can exceed 100%.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import bench_files
import numpy as np
from bandwidth import Stream, weight_bytes_per_token
from bench_files import gemma3_270m  # noqa: F401  (the old home of the wheel joiner)

PROMPT_TOKENS = 500
DECODE_TOKENS = 128  # --decode-tokens: fewer keep an 8B round (~3-5 tok/s here) short
MIN_CONTEXT = 4096  # KV cache tokens of each side (a round of a longer prompt takes more)


class TallowSide:
    """One compiled artifact and its runner; every round takes a fresh sequence."""

    name = "tallow"

    def __init__(self, artifact: Path, threads: int, context: int = MIN_CONTEXT) -> None:
        from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

        kv = KVCacheConfig(1, context, 512)
        self.runner = TVMModelRunner(artifact, kv=kv, threads=threads)
        self.vocab = self.runner.vocab_size
        self._seq = 0

    def run(self, prompt: list[int], steps: int = DECODE_TOKENS) -> tuple[float, float]:
        r = self.runner
        self._seq += 1
        r.add_sequence(self._seq)
        try:
            t = time.perf_counter()
            # in chunks, as the engine prefills (and llama.cpp, n_batch=512)
            for begin in range(0, len(prompt), r.prefill_chunk_size):
                logits = r.forward([(self._seq, prompt[begin : begin + r.prefill_chunk_size])])
            prefill = len(prompt) / (time.perf_counter() - t)
            token = int(np.argmax(logits[0]))
            t = time.perf_counter()
            for _ in range(steps):
                token = int(np.argmax(r.forward([(self._seq, [token])])[0]))
            decode = steps / (time.perf_counter() - t)
        finally:
            r.remove_sequence(self._seq)
        return prefill, decode


class LlamaCppSide:
    """llama.cpp through llama-cpp-python on the same file; its context is reset per round."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, threads: int, context: int = MIN_CONTEXT) -> None:
        from llama_cpp import Llama

        self.llm = Llama(str(gguf), n_ctx=context, n_threads=threads, n_batch=512, verbose=False)
        self.vocab = self.llm.n_vocab()

    def _last_logits(self) -> np.ndarray:
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,))

    def run(self, prompt: list[int], steps: int = DECODE_TOKENS) -> tuple[float, float]:
        llm = self.llm
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        prefill = len(prompt) / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(steps):
            llm.eval([int(np.argmax(self._last_logits()))])
        decode = steps / (time.perf_counter() - t)
        return prefill, decode


SIDES = {side.name: side for side in (TallowSide, LlamaCppSide)}


def _side_loop(kind: str, path: str, threads: int, context: int, conn) -> None:
    """A side's own process: load once, send the vocabulary size, then run each prompt sent
    and send back (prefill tok/s, decode tok/s); None ends it."""
    side = SIDES[kind](Path(path), threads, context)
    conn.send(side.vocab)
    while (job := conn.recv()) is not None:
        conn.send(side.run(*job))


class SideProcess:
    """One side in a spawned process, so the two runtimes never share one (see the docstring
    of this module)."""

    def __init__(self, kind: str, path: Path, threads: int, context: int) -> None:
        self.name = kind
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_side_loop, args=(kind, str(path), threads, context, child), daemon=True
        )
        self._proc.start()
        self.vocab = self._conn.recv()

    def run(self, prompt: list[int], steps: int = DECODE_TOKENS) -> tuple[float, float]:
        self._conn.send((prompt, steps))
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(timeout=30)


def _files(args, tmp: Path) -> list[tuple[str, Path]]:
    files = [(name, bench_files.shape_file(name)) for name in bench_files.expand(args.shape)]
    for g in args.gguf:
        path = gemma3_270m(tmp) if g == "gemma3-270m" else Path(g)
        files.append((path.name.removesuffix(".gguf"), path))
    if not files:
        from tallow.compiler.default_model import default_model_path

        files.append((bench_files.SMOLLM2, default_model_path()))
    return files


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument(
        "--gguf",
        action="append",
        default=[],
        help="a GGUF file, or gemma3-270m (the installed wheels); repeatable",
    )
    ap.add_argument(
        "--shape",
        action="append",
        default=[],
        help=f"repeatable: all, {', '.join(bench_files.SHAPE_NAMES)}",
    )
    ap.add_argument("--quant", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--artifact-dir", type=Path, default=None, help="keep compiled artifacts")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds idle between turns")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    ap.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS)
    ap.add_argument(
        "--stat", choices=sorted(STATS), default="median", help="of the rounds, per side"
    )
    ap.add_argument(
        "--same-process", action="store_true", help="both sides in this process (the old way)"
    )
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    files = _files(args, Path(tmp.name))
    sides, weights = {}, {}
    # both sides' caches hold a round (a 16k prompt needs more than the 4096 default)
    context = max(MIN_CONTEXT, args.prompt_tokens + args.decode_tokens + 16)
    for name, path in files:
        art = bench_files.compiled(path, args.artifact_dir, args.quant)
        weights[name] = weight_bytes_per_token(path)
        if args.same_process:
            sides[name] = (
                TallowSide(art, args.threads, context),
                LlamaCppSide(path, args.threads, context),
            )
        else:
            sides[name] = (
                SideProcess("tallow", art, args.threads, context),
                SideProcess("llama.cpp", path, args.threads, context),
            )
    stream = Stream(args.threads)
    streams = [stream.best()]
    before = bench_files.load_note()
    print(f"stream {streams[0]:.1f} GB/s; {before}", flush=True)
    results = {(n, s): [] for n in sides for s in ("tallow", "llama.cpp")}
    rng = np.random.default_rng(0)
    for r in range(args.rounds):
        for name, pair in sides.items():
            high = min(20000, pair[0].vocab, pair[1].vocab)
            prompt = [int(t) for t in rng.integers(100, high, size=args.prompt_tokens)]
            for side in pair if r % 2 == 0 else reversed(pair):
                time.sleep(args.settle)
                prefill, decode = side.run(prompt, args.decode_tokens)
                results[(name, side.name)].append((prefill, decode))
                streams.append(stream.best(3))
                print(f"round {r + 1} {name} {side.name}: prefill {prefill:.1f}, decode "
                      f"{decode:.2f} tok/s ({decode * weights[name] / 1e9:.1f} GB/s); stream "
                      f"{streams[-1]:.1f} GB/s; {bench_files.load_note()}", flush=True)  # fmt: skip
    ceiling = max(streams)
    print(f"\n{args.threads} threads, greedy, {args.stat} of {args.rounds} interleaved rounds, "
          f"tallow weights: {args.quant or 'as in file'}")  # fmt: skip
    print(f"before: {before}\nafter:  {bench_files.load_note()}")
    print(f"stream ({args.threads} threads, numpy, 1 GiB): best {ceiling:.1f} GB/s, "
          f"lowest {min(streams):.1f}")  # fmt: skip
    _table(args, sides, results, weights, ceiling)
    for pair in sides.values():
        for side in pair:
            getattr(side, "close", lambda: None)()


STATS = {"median": statistics.median, "best": max}


def _table(args, sides, results, weights, ceiling: float) -> None:
    """tok/s per side and their ratio, then decode's weight GB/s and share of the stream."""
    stat = STATS[args.stat]
    head = f" {'tallow':>10} {'llama.cpp':>10} {'ratio':>8}"
    band = f" {'GB/tok':>7} {'tallow GB/s':>12} {'%':>5} {'llama GB/s':>11} {'%':>5}"
    print(f"{'':<24} {f'prefill {args.prompt_tokens} tok/s':>30} "
          f"{f'decode {args.decode_tokens} tok/s':>30}")  # fmt: skip
    print(f"{'file':<24}{head}{head}{band}")
    for name in sides:
        ours = [stat(x[i] for x in results[(name, "tallow")]) for i in (0, 1)]
        theirs = [stat(x[i] for x in results[(name, "llama.cpp")]) for i in (0, 1)]
        cells = "".join(
            f" {ours[i]:>10.2f} {theirs[i]:>10.2f} {ours[i] / theirs[i]:>8.2f}" for i in (0, 1)
        )
        gb = weights[name] / 1e9
        rates = [d * gb for d in (ours[1], theirs[1])]
        cells += f" {gb:>7.2f} {rates[0]:>12.1f} {100 * rates[0] / ceiling:>5.0f}"
        cells += f" {rates[1]:>11.1f} {100 * rates[1] / ceiling:>5.0f}"
        print(f"{name:<24}{cells}")


if __name__ == "__main__":
    main()
