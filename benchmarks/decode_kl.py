"""What decode's int8 activations cost in quality, per CPU level: a GGUF's kept types compiled
for this machine's CPU (`native`) and for `x86-64-v3` (the AVX2 row kernels), each fed the text
one token at a time through the decode kernels, against the f32 artifact of the same weights
(the file's blocks dequantized) run by prefill at every position.

    .venv/bin/python benchmarks/decode_kl.py [--model GGUF] [--tokens 300]
        [--levels native x86-64-v3] [--out /work/shapes/decode-kl]

Default model: the real Gemma 3 270M Q4_K_M (`bench_files.REAL_GEMMA`: its attention outputs
and half its down projections are q4k, which on AVX2 take `int8_kquant_row`'s per-super-block
activation step). Both sides hold the same weights, so the KL is what the decode path adds:
int8 activation rounding, float summation order and the attention kernels. Prints per level:
perplexity, KL(f32 || level) mean / median / p99 / max, top-1 agreement; and the KL between the
first two levels. Artifacts are kept in `--out` and reused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import bench_files
import numpy as np

from tallow.compiler.pipeline import CompileOptions, compile_model
from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "prose.txt"


def artifact(model: Path, folder: Path, **options) -> Path:
    """The artifact compiled into `folder`, or the one already there."""
    found = sorted(folder.glob("*/manifest.yaml")) if folder.exists() else []
    if found:
        return found[0].parent
    return compile_model(CompileOptions(model=str(model), output=folder, quiet=True, **options))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, from log-probabilities."""
    return (np.exp(p) * (p - q)).sum(axis=-1)


def decoded(folder: Path, tokens: list[int]) -> np.ndarray:
    """Log-probabilities after each token, fed one at a time (decode steps)."""
    runner = TVMModelRunner(folder, kv=KVCacheConfig(1, 4096, 512))
    runner.add_sequence(0)
    rows = [np.array(runner.forward([(0, [t])]), copy=True).reshape(-1) for t in tokens]
    return log_softmax(np.stack(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: Gemma 3 270M)")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--levels", nargs="+", default=["native", "x86-64-v3"])
    ap.add_argument("--out", type=Path, default=Path("/work/shapes/decode-kl"))
    args = ap.parse_args()
    model = args.model or bench_files.shape_file(bench_files.REAL_GEMMA, args.out)
    ref_art = artifact(model, args.out / "f32", quant="f32", allow_requantize=True)
    ref_runner = TVMModelRunner(ref_art, kv=KVCacheConfig(1, 4096, 512))
    tokens = ref_runner.tokenizer.tokenizer.encode(TEXT.read_text()).ids[: args.tokens]
    ref_runner.add_sequence(0)
    ref = log_softmax(np.asarray(ref_runner.forward_prompt_logits([(0, tokens)])[0]))
    del ref_runner
    levels = {
        level: decoded(artifact(model, args.out / level, cpu=[level]), tokens)
        for level in args.levels
    }
    positions = np.arange(len(tokens) - 1)

    def ppl(lp: np.ndarray) -> float:
        return float(np.exp(-lp[positions, tokens[1:]].mean()))

    print(
        f"{model.name}, {len(tokens)} tokens of tests/data/prose.txt; "
        f"f32 prefill ppl {ppl(ref):.4f}"
    )
    for level, lp in levels.items():
        k = kl(ref, lp)
        top = (ref.argmax(-1) == lp.argmax(-1)).mean()
        print(
            f"{level:>10}: decode ppl {ppl(lp):.4f}, KL(f32 || it) mean {k.mean():.5f} median "
            f"{np.median(k):.5f} p99 {np.percentile(k, 99):.4f} max {k.max():.4f}, top-1 {top:.4f}"
        )
    if len(levels) > 1:
        (a, pa), (b, pb) = list(levels.items())[:2]
        k = kl(pa, pb)
        print(f"KL({a} || {b}) mean {k.mean():.5f} max {k.max():.4f}")


if __name__ == "__main__":
    main()
