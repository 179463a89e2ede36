"""CPU decode and prefill speed of tallow and llama.cpp side by side, on the same GGUF file.

    .venv/bin/pip install llama-cpp-python==0.3.36      # builds llama.cpp (~10 min, 2 cores)
    .venv/bin/python benchmarks/cpu_vs_llamacpp.py [--gguf FILE] [--quant q4k] [--threads 2]

Both run greedy with the same thread count in one process, one after the other; the table
shows tok/s and the ratio tallow / llama.cpp (>1 means tallow is faster). `--quant` makes
tallow requantize (llama.cpp keeps running the file's own types).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPT_TOKENS = 500
DECODE_TOKENS = 128


def bench_tallow(
    gguf: Path, quant: str | None, threads: int, prompt: list[int]
) -> tuple[float, float]:
    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    with tempfile.TemporaryDirectory() as tmp:
        art = compile_model(
            CompileOptions(  # --quant requantizes the GGUF on purpose (a noted comparison)
                model=str(gguf), quant=quant, allow_requantize=True, output=Path(tmp), quiet=True
            )
        )
        runner = TVMModelRunner(art, kv=KVCacheConfig(1, 4096, 512), threads=threads)
        runner.add_sequence(0)
        t = time.perf_counter()
        logits = runner.forward([(0, prompt)])
        prefill = len(prompt) / (time.perf_counter() - t)
        token = int(np.argmax(logits[0]))
        t = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            token = int(np.argmax(runner.forward([(0, [token])])[0]))
        decode = DECODE_TOKENS / (time.perf_counter() - t)
    return prefill, decode


def bench_llamacpp(gguf: Path, threads: int, prompt: list[int]) -> tuple[float, float]:
    import llama_cpp
    from llama_cpp import Llama

    def last_logits(llm) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))

    llm = Llama(str(gguf), n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)
    t = time.perf_counter()
    llm.eval(prompt)
    prefill = len(prompt) / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        token = int(np.argmax(last_logits(llm)))
        llm.eval([token])
    decode = DECODE_TOKENS / (time.perf_counter() - t)
    return prefill, decode


def main() -> None:
    from tallow.compiler.default_model import default_model_path

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", type=Path, default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    gguf = args.gguf or default_model_path()
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 20000, size=PROMPT_TOKENS)]
    ours = bench_tallow(gguf, args.quant, args.threads, prompt)
    theirs = bench_llamacpp(gguf, args.threads, prompt)
    print(
        f"{gguf.name}, {args.threads} threads, greedy; tallow weights: {args.quant or 'as in file'}"
    )
    print(f"{'':>20} {'tallow':>9} {'llama.cpp':>10} {'ratio':>6}")
    for i, what in enumerate((f"prefill {PROMPT_TOKENS} tok/s", f"decode {DECODE_TOKENS} tok/s")):
        print(f"{what:>20} {ours[i]:>9.1f} {theirs[i]:>10.1f} {ours[i] / theirs[i]:>6.2f}")


if __name__ == "__main__":
    main()
