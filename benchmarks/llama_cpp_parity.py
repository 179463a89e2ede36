"""Does tallow compute what llama.cpp computes on the same GGUF? Perplexity and KL, each
engine against its own f32 reference, and the two engines against each other, on i-quant
files (issue 39's goal: an IQ4_XS and an IQ3_M file score as llama.cpp scores them).

    .venv/bin/python benchmarks/llama_cpp_parity.py [--model GGUF] [--ftype IQ4_XS IQ3_M Q4_K_M]
        [--text FILE] [--context 512] [--tokens N] [--threads 2]

For a source GGUF (default: the embedded SmolLM2-135M-Instruct Q4_1), llama.cpp
(`llama_cpp.llama_model_quantize`, allow_requantize) writes an F32 file and one file per
`--ftype`. tallow compiles each file keeping its tensor types; llama.cpp (llama-cpp-python)
loads the same files. Both run the same token ids through the same windows
(`runtime/evaluate.py`'s `evaluate_logits`, llama-perplexity's windows) and are scored by the
same code. Per file the table gives:
  - each engine's perplexity, and its KL / top-1 agreement against its own F32 run;
  - KL(llama.cpp || tallow) on the file itself: the kernels' disagreement, the quantity that
    says whether tallow reads and runs the type as llama.cpp does.
The F32 row's cross KL is the floor two correct float engines reach (summation order).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from quant_quality import TEXT, compile_artifact, gguf_size, llama_cpp_quantize

from tallow.compiler.default_model import default_model_path
from tallow.runtime.evaluate import bos_of, evaluate_logits, text_tokens
from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner, all_position_logits


def tallow_logits(artifact: Path, context: int):
    runner = TVMModelRunner(artifact, kv=KVCacheConfig(1, context + 64))
    return runner, lambda window, first: all_position_logits(runner, window, start=first)[:-1]


def llama_cpp_logits(gguf_path: Path, context: int, threads: int):
    import llama_cpp

    llm = llama_cpp.Llama(
        str(gguf_path),
        n_ctx=context,
        n_batch=context,
        logits_all=True,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def logits_of(window: list[int], first: int) -> np.ndarray:
        llm.reset()  # every window from an empty cache, as tallow's
        llm.eval(window)
        return np.array(llm.scores[first : len(window) - 1], dtype=np.float32)

    return logits_of


def cached(logits_of):
    """One forward per window however many comparisons read it."""
    memo: dict = {}

    def of(window: list[int], first: int) -> np.ndarray:
        key = (tuple(window), first)
        if key not in memo:
            memo[key] = logits_of(window, first)
        return memo[key]

    return of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, help="source GGUF (default: embedded SmolLM2)")
    ap.add_argument("--ftype", nargs="+", default=["IQ4_XS", "IQ3_M", "Q4_K_M"])
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=0, help="cut the text to N tokens (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = args.model or default_model_path()
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    lines = [
        "| file | bits/weight | tallow ppl | llama.cpp ppl | tallow KL vs its F32 "
        "| llama.cpp KL vs its F32 | top-1 vs F32 (tallow / llama.cpp) "
        "| KL(llama.cpp ‖ tallow) p99 / max | same top-1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        files = {ftype: llama_cpp_quantize(model, ftype, out) for ftype in ["F32", *args.ftype]}
        say("F32: compiling and loading")
        artifacts = {"F32": compile_artifact(files["F32"], None, out, "llama-cpp-f32")}
        runner, ours_f32 = tallow_logits(artifacts["F32"], args.context)
        ours_f32 = cached(ours_f32)
        theirs_f32 = cached(llama_cpp_logits(files["F32"], args.context, args.threads))
        tokens = text_tokens(runner, args.text.read_text())
        tokens = tokens[: args.tokens] if args.tokens else tokens
        bos = bos_of(runner)
        for ftype, path in files.items():
            say(f"{ftype}: compiling and scoring")
            if ftype not in artifacts:
                name = f"llama-cpp-{ftype.lower()}"
                artifacts[ftype] = compile_artifact(path, None, out, name)
            ours = (
                ours_f32
                if ftype == "F32"
                else cached(tallow_logits(artifacts[ftype], args.context)[1])
            )
            theirs = (
                theirs_f32
                if ftype == "F32"
                else cached(llama_cpp_logits(path, args.context, args.threads))
            )
            ctx = args.context
            tallow_vs_f32 = evaluate_logits(ours, tokens, ctx, bos, ours_f32)
            llama_vs_f32 = evaluate_logits(theirs, tokens, ctx, bos, theirs_f32)
            cross = evaluate_logits(ours, tokens, ctx, bos, theirs)
            bpw = gguf_size(path)[1]
            lines.append(
                f"| {ftype} | {bpw:.2f} | {tallow_vs_f32.perplexity:.4f} | "
                f"{llama_vs_f32.perplexity:.4f} | {tallow_vs_f32.kl_mean:.5f} | "
                f"{llama_vs_f32.kl_mean:.5f} | {100 * tallow_vs_f32.top1_agreement:.1f}% / "
                f"{100 * llama_vs_f32.top1_agreement:.1f}% | {cross.kl_p99:.5f} / "
                f"{cross.kl_max:.5f} | {100 * cross.top1_agreement:.1f}% |"
            )
        print(
            f"{model.name} requantized by llama.cpp; {args.text.name}: "
            f"{tallow_vs_f32.tokens_scored} tokens scored in {tallow_vs_f32.windows} windows of "
            f"{args.context}, {args.threads} threads each side\n"
        )
        print("\n".join(lines))


if __name__ == "__main__":
    main()
