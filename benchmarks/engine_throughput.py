"""Engine throughput on one artifact: aggregate generated tok/s at several concurrency levels,
and the per-step host overhead outside the compiled functions.

    .venv/bin/python benchmarks/engine_throughput.py artifacts/smollm2-135m-instruct.q4_1-f32-cpu
    .venv/bin/python benchmarks/engine_throughput.py --shape all [--gguf FILE] \
        [--artifact-dir /work/shapes/artifacts]

`--sampling` picks greedy, top-p or top-k requests; `--host-sampler` samples with numpy on
the host instead of the artifact's compiled sampler (for a side-by-side run). `--baseline`
names a second artifact (say, one built before a change) that runs interleaved with the first,
round by round, and gets its own table: the two are compared under the same load.
`--deterministic` runs every configuration twice, interleaved, in the normal and in the
deterministic (batch-invariant) mode, one table each, then a last table of each artifact's
deterministic over normal tok/s at each concurrency level (the cost of the mode).

`--shape NAME` (repeatable; `all`: bench_files.SHAPE_NAMES, the Q4_K_M stand-ins of real
shapes and the real Gemma 3 270M and SmolLM2 files) and `--gguf FILE` add GGUF files, each
compiled once (kept in `--artifact-dir`); every artifact runs in the same interleaved rounds,
and a last table gives each one's highest level over its single-request rate.

Prints one table per artifact; the ratio column is aggregate throughput over single-request
throughput. This machine's shared cores make single runs vary by 20% or more, so the
concurrency levels run in rounds (`--rounds`, interleaved: 1, 4, 16, 1, 4, 16, ...) and the
table shows each level's median; the spread column is its lowest and highest tok/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

import numpy as np

from tallow.runtime.cpu_threads import usable_cpus
from tallow.runtime.engine_factory import EngineOptions, build_engine
from tallow.runtime.model_runner_protocol import SAMPLER_FUNCTION
from tallow.runtime.sampling_params import SamplingParams

SAMPLING = {
    "greedy": SamplingParams(temperature=0.0),
    "top-p": SamplingParams(temperature=0.8, top_p=0.95, seed=1),
    "top-k": SamplingParams(temperature=0.8, top_k=40, seed=1),
}


def _timed(fn, total: list[float]):
    def timed(*args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            total[0] += time.perf_counter() - t

    return timed


def run(
    artifact: str,
    concurrency: int,
    max_tokens: int,
    prompt_len: int,
    sampling: str,
    host: bool,
    deterministic: bool = False,
) -> dict:
    options = EngineOptions(max_num_seqs=max(concurrency, 1), deterministic=deterministic)
    engine = build_engine(artifact, options)
    engine.sampling.on_device &= not host
    runner = engine.runner
    # Time in compiled functions: the forward, and the compiled sampler's VM call (its
    # inputs' packing and copy stay on the host side of the ledger).
    forward_time = [0.0]
    runner.forward = _timed(runner.forward, forward_time)
    funcs = getattr(runner, "_funcs", {})
    if SAMPLER_FUNCTION in funcs:
        funcs[SAMPLER_FUNCTION] = _timed(funcs[SAMPLER_FUNCTION], forward_time)
    rng = np.random.default_rng(0)
    prompts = [
        [int(t) for t in rng.integers(100, 20000, size=prompt_len)] for _ in range(concurrency)
    ]
    params = dataclasses.replace(SAMPLING[sampling], max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.submit(p, params, lambda _o: None)
    # prefill everything first (each request's first token comes from its prefill), so the
    # timed part is steady-state decoding
    while engine.stats().generated_tokens < concurrency:
        engine.run_step()
    forward_time[0] = 0.0
    steps0, gen0 = engine.stats().num_steps, engine.stats().generated_tokens
    t0 = time.perf_counter()
    while engine._has_work():
        engine.run_step()
    wall = time.perf_counter() - t0
    st = engine.stats()
    steps, generated = st.num_steps - steps0, st.generated_tokens - gen0
    return {
        "device_rows": engine.sampling.device_rows,
        "concurrency": concurrency,
        "tok_s": generated / wall,
        "overhead_ms": (wall - forward_time[0]) / max(steps, 1) * 1e3,
        "step_ms": wall / max(steps, 1) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    # Every CPU, as docs/benchmarks.md's figures were measured (the runtime's default leaves
    # one free: runtime/cpu_threads.py); TVM_NUM_THREADS set by the caller wins.
    os.environ.setdefault("TVM_NUM_THREADS", str(usable_cpus()))
    ap.add_argument("artifact", nargs="?", help="an artifact folder")
    ap.add_argument("--shape", action="append", default=[], help="a bench_files shape; all")
    ap.add_argument("--gguf", action="append", default=[], help="a GGUF file (compiled once)")
    ap.add_argument("--artifact-dir", type=Path, default=None, help="keep compiled artifacts")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy")
    ap.add_argument("--baseline", help="a second artifact, run interleaved with the first")
    ap.add_argument(
        "--host-sampler",
        action="store_true",
        help="sample on the host, not with the compiled sampler",
    )
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="also run each configuration in deterministic mode, interleaved",
    )
    args = ap.parse_args()
    artifacts = [args.artifact] if args.artifact else []
    artifacts += _compiled_files(args)
    if not artifacts:
        ap.error("name an artifact, --shape or --gguf")
    artifacts += [args.baseline] if args.baseline else []
    modes = [False, True] if args.deterministic else [False]
    runs = {(a, m, c): [] for a in artifacts for m in modes for c in args.concurrency}
    for _ in range(args.rounds):
        for c in args.concurrency:
            for artifact in artifacts:
                for mode in modes:
                    runs[(artifact, mode, c)].append(
                        run(
                            artifact,
                            c,
                            args.max_tokens,
                            args.prompt_len,
                            args.sampling,
                            args.host_sampler,
                            mode,
                        )
                    )
    for artifact in artifacts:
        for mode in modes:
            table = {c: runs[(artifact, mode, c)] for c in args.concurrency}
            _print_table(artifact, table, args, "deterministic" if mode else "normal")
    if len(artifacts) > 1:
        _print_ratios(artifacts, runs, args)
    if args.deterministic:
        _print_mode_cost(artifacts, runs, args)


def _compiled_files(args) -> list[str]:
    """Artifacts of the --shape and --gguf files, compiled on first use."""
    if not (args.shape or args.gguf):
        return []
    import bench_files  # benchmarks/ is on the path when this script runs

    files = [bench_files.shape_file(n) for n in bench_files.expand(args.shape)]
    files += [Path(g) for g in args.gguf]
    return [str(bench_files.compiled(f, args.artifact_dir)) for f in files]


def _print_ratios(artifacts: list[str], runs: dict, args) -> None:
    low, high = args.concurrency[0], args.concurrency[-1]
    print(f"\naggregate tok/s at {high} over {low} concurrent requests (medians, normal mode)")
    print(f"{'artifact':<40} {f'{low} req':>8} {f'{high} req':>8} {'ratio':>6}")
    for artifact in artifacts:
        a, b = (
            statistics.median(r["tok_s"] for r in runs[(artifact, False, c)]) for c in (low, high)
        )
        print(f"{Path(artifact).name:<40} {a:>8.1f} {b:>8.1f} {b / a:>6.2f}")


def _print_mode_cost(artifacts: list[str], runs: dict, args) -> None:
    print("\ndeterministic against normal mode: median tok/s (lowest-highest), ratio of medians")
    print(f"{'artifact':<40} {'concurrent':>10} {'normal':>20} {'deterministic':>20} {'ratio':>6}")
    for artifact in artifacts:
        for c in args.concurrency:
            cells = []
            for mode in (False, True):
                tok = [r["tok_s"] for r in runs[(artifact, mode, c)]]
                cells.append((statistics.median(tok), min(tok), max(tok)))
            (normal, *_), (det, *_) = cells
            text = [f"{m:.1f} ({lo:.1f}-{hi:.1f})" for m, lo, hi in cells]
            print(
                f"{Path(artifact).name:<40} {c:>10} {text[0]:>20} {text[1]:>20} "
                f"{det / normal:>6.2f}"
            )


def _print_table(artifact: str, runs: dict[int, list[dict]], args, mode: str) -> None:
    first = next(iter(runs.values()))[0]
    where = "host" if args.host_sampler or not first["device_rows"] else "compiled"
    print(f"{artifact} ({mode} mode)\nsampling: {args.sampling}, {where} sampler")

    def median(c: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[c])

    base = median(args.concurrency[0], "tok_s")
    print(
        f"{'concurrent':>10} {'tok/s':>9} {'ratio':>6} {'step ms':>8} {'host ms/step':>13} "
        f"{'spread tok/s':>14}"
    )
    for c in args.concurrency:
        tok = [r["tok_s"] for r in runs[c]]
        print(
            f"{c:>10} {median(c, 'tok_s'):>9.1f} {median(c, 'tok_s') / base:>6.2f} "
            f"{median(c, 'step_ms'):>8.2f} {median(c, 'overhead_ms'):>13.3f} "
            f"{min(tok):>6.1f}-{max(tok):<6.1f}"
        )


if __name__ == "__main__":
    main()
