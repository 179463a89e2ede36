"""Per-kernel time of a decode step (and of a prompt's prefill) of a compiled CPU artifact.

    python benchmarks/decode_profile.py ARTIFACT|FILE.gguf|SHAPE [--batch 1 16] [--context 500]
        [--prefill] [--steps 8] [--out-dir /work/shapes]

SHAPE is a name of bench_files.SHAPE_NAMES (`all` for every one); a GGUF is compiled once into
`--artifact-dir`. The step is `TVMModelRunner.forward`, exactly what the engine calls: `embed`,
then `decode` / `batch_decode` (or `batch_prefill`) on the paged KV cache. Every VM call
instruction is timed with the Relax VM's instrument hook (TVM 0.27's VM has no profiler of
its own): time is summed per kernel name over the step, nested calls counted once (a
closure's own time excludes its callees). "outside VM calls" is the rest of the step: the
host side of `forward`, the KV cache's begin/end and the VM's interpretation. The untimed
step time is measured first with no hook, so the hook's own cost shows as the difference.

Each of the `--batch` sequences is prefilled with its own random `--context`-token prompt
(distinct KV pages, as in serving; `--fork-context` forks one instead, quicker), then
`--steps` decode steps are timed after two warm-up steps. `--prefill` also profiles one
`--context`-token prefill of a fresh sequence. `--deterministic` decodes as `--deterministic`
serving does: a lone sequence through `batch_decode` too (what the mode costs it, per kernel).
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict
from pathlib import Path

import bench_files
import numpy as np

WARMUP_STEPS = 2


class CallTimer:
    """A Relax VM instrument: exclusive wall time and count per called function name, and
    which model weights each kernel reads (`weights`: data address -> name)."""

    def __init__(self, weights: dict[int, str]) -> None:
        self.time: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.reads: dict[str, set[str]] = defaultdict(set)
        self._weights = weights
        self._stack: list[list[float]] = []  # [start, time spent in nested calls]

    def __call__(self, func, name, before_run, ret_value, *args) -> int:
        if before_run:
            for a in args:
                weight = self._weights.get(getattr(a, "data_ptr", int)())
                if weight:
                    self.reads[str(name)].add(weight)
            self._stack.append([time.perf_counter(), 0.0])  # the lookup above is not timed
            return 0
        now = time.perf_counter()
        start, nested = self._stack.pop()
        spent = now - start
        self.time[str(name)] += spent - nested
        self.calls[str(name)] += 1
        if self._stack:
            self._stack[-1][1] += spent
        return 0  # VMInstrumentReturnKind.NO_OP

    def reset(self) -> None:
        self.time.clear()
        self.calls.clear()


def _table(timer: CallTimer, steps: int, step_s: float, plain_s: float, title: str) -> str:
    total = step_s / steps
    rows = sorted(timer.time.items(), key=lambda kv: -kv[1])
    inside = sum(timer.time.values()) / steps
    lines = [
        title,
        f"# step: {plain_s / steps * 1e3:.2f} ms untimed, {total * 1e3:.2f} ms with the hook "
        f"(VM calls {inside * 1e3:.2f} ms); mean of {steps} step(s)",
        f"{'ms/step':>9} {'%':>6} {'calls':>6}  kernel",
    ]
    for name, t in rows:
        t /= steps
        calls = timer.calls[name] / steps
        reads = f"  [{', '.join(sorted(timer.reads[name]))}]" if timer.reads[name] else ""
        lines.append(f"{t * 1e3:>9.3f} {100 * t / total:>6.1f} {calls:>6.0f}  {name}{reads}")
    rest = total - inside
    lines.append(f"{rest * 1e3:>9.3f} {100 * rest / total:>6.1f} {'':>6}  (outside VM calls)")
    lines.append(f"{total * 1e3:>9.3f} {100.0:>6.1f} {'':>6}  total")
    return "\n".join(lines) + "\n"


def _timed(runner, items, steps: int, timer: CallTimer | None, feed) -> float:
    """Seconds for `steps` forwards of `items` (`feed` gives each step's next tokens)."""
    runner.vm.set_instrument(timer)  # None: no hook at all
    t = time.perf_counter()
    for _ in range(steps):
        items = feed(runner.forward(items), items)
    return time.perf_counter() - t


def profile(
    art: Path,
    batches: list[int],
    context: int,
    steps: int,
    prefill: bool,
    threads: int,
    fork: bool = False,
    deterministic: bool = False,
):
    """(kind, table text) for the optional prefill, then each batch's decode step."""
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    top = max(batches)
    pages = (context + WARMUP_STEPS + 2 * steps + 64) * (top + 1)
    # the prompt in one forward: a prefill chunk as long as the context (default 512)
    chunk = max(512, context)
    runner = TVMModelRunner(art, kv=KVCacheConfig(top, pages, chunk), threads=threads)
    runner.batch_invariant = deterministic
    # weight names without the layer: "mlp.down_proj" for "model.layers.3.mlp.down_proj.weight"
    names = [p.name for p in runner.manifest.params_for(runner.library)]
    weights = {
        t.data_ptr(): re.sub(r"^model\.(layers\.\d+\.)?|\.weight$", "", n)
        for t, n in zip(runner.params, names, strict=True)
    }
    rng = np.random.default_rng(0)
    note = bench_files.load_note()
    mode = ", deterministic mode" if deterministic else ""
    head = f"# {art.name}, {threads} threads, context {context}{mode}; {note} at start"

    def prompt() -> list[int]:
        return [int(t) for t in rng.integers(100, min(20000, runner.vocab_size), size=context)]

    def next_tokens(logits, items):
        rows = np.asarray(logits)
        return [(s, [int(np.argmax(row))]) for (s, _), row in zip(items, rows, strict=True)]

    if prefill:
        timer = CallTimer(weights)
        runner.add_sequence(10_000)
        plain = _timed(runner, [(10_000, prompt())], 1, None, lambda _l, i: i)
        runner.remove_sequence(10_000)
        runner.add_sequence(10_001)
        hooked = _timed(runner, [(10_001, prompt())], 1, timer, lambda _l, i: i)
        runner.remove_sequence(10_001)
        title = f"{head}\n# prefill of {context} tokens, one sequence ({bench_files.load_note()})"
        yield f"prefill{context}", _table(timer, 1, hooked, plain, title)
    ready = 0
    for batch in sorted(batches):
        for seq in range(ready, batch):
            if fork and seq > 0:
                runner.fork_sequence(0, seq, context)
            else:
                runner.add_sequence(seq)
                runner.forward([(seq, prompt())])
        ready = max(ready, batch)
        items = [(s, [int(rng.integers(100, 20000))]) for s in range(batch)]
        _timed(runner, items, WARMUP_STEPS, None, next_tokens)
        plain = _timed(runner, items, steps, None, next_tokens)
        timer = CallTimer(weights)
        hooked = _timed(runner, items, steps, timer, next_tokens)
        shared = ", contexts forked from one prompt (shared KV pages)" if fork and batch > 1 else ""
        title = f"{head}\n# decode step, batch {batch}{shared} ({bench_files.load_note()})"
        runner.vm.set_instrument(None)
        yield f"b{batch}", _table(timer, steps, hooked, plain, title)


def _target(spec: str, artifact_dir: Path | None) -> tuple[str, Path]:
    """(label, artifact folder) of an artifact folder, a GGUF file or a shape name."""
    path = Path(spec)
    if path.is_dir():
        return path.name, path
    if path.suffix == ".gguf":
        return path.name.removesuffix(".gguf"), bench_files.compiled(path, artifact_dir)
    return spec, bench_files.compiled(bench_files.shape_file(spec), artifact_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="+", help="artifact folders, GGUF files or shape names")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill", action="store_true", help="also profile a --context prefill")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--fork-context",
        action="store_true",
        help="one prefill forked to every sequence: faster setup, but attention then reads "
        "shared (cache-warm) KV pages",
    )
    ap.add_argument("--deterministic", action="store_true", help="decode as --deterministic")
    ap.add_argument("--artifact-dir", type=Path, default=bench_files.DEFAULT_ARTIFACTS)
    ap.add_argument("--out-dir", type=Path, help="write profile-<name>-<b1|prefill500>.txt here")
    args = ap.parse_args()
    names = [t for t in args.targets if t not in (*bench_files.SHAPE_NAMES, "all")]
    shapes = bench_files.expand([t for t in args.targets if t not in names])
    for spec in [*names, *shapes]:
        label, art = _target(spec, args.artifact_dir)
        tables = profile(
            art,
            args.batch,
            args.context,
            args.steps,
            args.prefill,
            args.threads,
            args.fork_context,
            args.deterministic,
        )
        for kind, text in tables:
            print(text, flush=True)
            if args.out_dir:
                args.out_dir.mkdir(parents=True, exist_ok=True)
                (args.out_dir / f"profile-{label}-{kind}.txt").write_text(text)


if __name__ == "__main__":
    main()
