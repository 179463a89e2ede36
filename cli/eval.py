"""`tallow eval`: perplexity of an artifact on a text, and its divergence from a reference.

Runs through the runtime only (`tallow.runtime.evaluate`); the parser is defined here so
`cli/main.py` only registers it. Progress goes to stderr; the one-line summary (or, with
`--json`, one JSON object) to stdout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tallow.cli.arg_types import THREADS_HELP, add_device, positive_int
from tallow.runtime.errors import TallowError

DESCRIPTION = (
    "Perplexity of an artifact on a text file, in windows of --context tokens scored as "
    "llama.cpp's llama-perplexity scores them (each window from an empty cache, only its "
    "second half scored, BOS first when the tokenizer adds one), so the figures compare with "
    "llama.cpp's on the same text. With --reference (typically the f32 artifact of the same "
    "model): KL divergence of the reference's next-token distribution to this artifact's "
    "(mean and 99th percentile, as llama-perplexity --kl-divergence reports), top-1 agreement "
    "and the change in perplexity. The text needs at least two windows of tokens."
)


def add_eval_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="perplexity of an artifact on a text; KL divergence against a reference",
        description=DESCRIPTION,
    )
    p.add_argument("artifact", type=_artifact_arg, help=_ARTIFACT_HELP)
    p.add_argument("--text", type=Path, required=True, help="a UTF-8 text file to score")
    p.add_argument(
        "--reference",
        type=_artifact_arg,
        help="an artifact of the same model (same tokenizer) to compare with, e.g. its f32 one",
    )
    p.add_argument(
        "--context", type=int, default=512, help="tokens per window (default 512, as llama.cpp)"
    )
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    add_device(p)
    p.add_argument("--threads", type=positive_int, help=THREADS_HELP)


def run_eval(args) -> int:
    from tallow.runtime.evaluate import check_context, evaluate, text_tokens

    text = _read_text(args.text)
    check_context(args.context)  # before loading the models
    runner = _load(args.artifact, args)
    reference = _load(args.reference, args) if args.reference is not None else None
    same = reference is not None and same_weights(runner, reference)
    if same:
        print(
            f"note: {args.reference} has the very same weights as {args.artifact} (identical "
            "shards): expect KL 0 and no change in perplexity, which says nothing about a "
            "weight format; the reference is meant to be the model's f32 artifact",
            file=sys.stderr,
        )
    tokens = text_tokens(runner, text)
    progress = _Progress()
    started = time.perf_counter()
    result = evaluate(runner, tokens, args.context, reference, on_window=progress.update)
    seconds = time.perf_counter() - started
    if args.json:
        figures = {
            "artifact": str(args.artifact),
            "reference": None if reference is None else str(args.reference),
            "text": str(args.text),
            **result.as_dict(),
            "same_weights": same,
            "seconds": round(seconds, 3),
        }
        print(json.dumps(figures))
    else:
        print(summary_line(result))
    return 0


def same_weights(a, b) -> bool:
    """Whether two loaded artifacts hold the very same weights: the same parameters (names,
    shapes, types) in shards of the same sha256 (False when either has no checksums)."""
    ma, mb = a.manifest, b.manifest
    if ma.checksums is None or mb.checksums is None:
        return False
    pa, pb = ma.params_for(a.library), mb.params_for(b.library)

    def key(params, checksums):
        return [(p.name, p.shape, p.dtype, p.quant, checksums[p.shard]["sha256"]) for p in params]

    try:
        return key(pa, ma.checksums) == key(pb, mb.checksums)
    except KeyError:  # a shard without a recorded checksum
        return False


def summary_line(result) -> str:
    line = (
        f"perplexity {result.perplexity:.4f} over {result.tokens_scored} tokens "
        f"({result.windows} windows of {result.context})"
    )
    if result.reference_perplexity is None:
        return line
    return (
        f"{line} | reference {result.reference_perplexity:.4f} "
        f"(delta {result.delta_perplexity:+.4f}) | KL mean {result.kl_mean:.6f}, "
        f"p99 {result.kl_p99:.6f} | top-1 agreement {100 * result.top1_agreement:.2f}%"
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TallowError(f"--text {path}: no such file") from None
    except IsADirectoryError:
        raise TallowError(f"--text {path}: is a folder, not a text file") from None
    except UnicodeDecodeError as e:
        raise TallowError(f"--text {path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise TallowError(f"--text {path}: cannot read it ({e.strerror})") from e


def _artifact_arg(value: str):
    from tallow.cli.hub import artifact_arg

    return artifact_arg(value)


_ARTIFACT_HELP = "artifact folder written by `tallow compile`, or hf://org/repo[@revision]"


def _load(spec, args):
    from tallow.cli.hub import artifact_folder
    from tallow.runtime.manifest import Manifest
    from tallow.runtime.model_runner import KVCacheConfig
    from tallow.runtime.tp_runner import runner_class

    folder = artifact_folder(spec, args.device)  # hf://: pulled and checked

    # One sequence at a time, one window long (a page more for rounding).
    kv = KVCacheConfig(max_batch_size=1, max_total_tokens=args.context + 64)
    runner = runner_class(Manifest.read(Path(folder)))
    return runner(folder, device=args.device, kv=kv, threads=args.threads)


class _Progress:
    """`windows done/total` redrawn in place on a terminal; on a pipe, a line per tenth."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, done: int, total: int) -> None:
        step = max(1, total // 10)
        if not self.tty and done % step and done != total:
            return
        width = 30
        bar = "#" * (width * done // total)
        elapsed = time.perf_counter() - self.started
        line = f"eval [{bar:<{width}}] {done}/{total} windows, {elapsed:.1f}s"
        if self.tty:
            print(f"\r{line}", end="\n" if done == total else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)
