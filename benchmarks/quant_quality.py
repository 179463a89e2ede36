"""What each weight mix costs in quality: tallow's `--quant` mixes and llama.cpp's own
quantization of the same source, each scored by `tallow eval` against the same f32 artifact.

    .venv/bin/python benchmarks/quant_quality.py [--model GGUF] [--quant q4_0 q8_0 q4k ...]
        [--text FILE] [--context 512] [--tokens N] [--no-llama-cpp]

For a source GGUF (default: the embedded SmolLM2-135M-Instruct Q4_1), compiles
  - the f32 artifact (the source's blocks dequantized): the reference;
  - one artifact per `--quant` name, requantized by tallow from those f32 weights;
  - llama.cpp's quantization of the same source to the matching ftype (`q4k_m` -> Q4_K_M,
    `q4k` -> Q4_K_M as llama-quantize reads Q4_K, `q6k` -> Q6_K, `q4_0` -> Q4_0 ...), written
    by `llama_cpp.llama_model_quantize` with allow_requantize and compiled by tallow keeping
    its tensor types. Both sides then run through the same kernels and the same evaluation:
    the table isolates the choice of mix.
Every row is `tallow eval` (runtime/evaluate.py: llama-perplexity's windows, KL of the f32
distribution to the row's) on the same text. Size and bits per weight count every tensor
(norms included): of the artifact's weights for tallow's rows, of the GGUF for llama.cpp's.
A footnote names a llama.cpp row that tallow ran with more bits than its GGUF holds (a tensor
type tallow dequantized to float). Prints a markdown table.

When the source is itself quantized (SmolLM2 ships Q4_1), every row is a requantization of
its dequantized weights: the table says so.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tallow.compiler.default_model import default_model_path
from tallow.compiler.pipeline import CompileOptions, compile_model
from tallow.compiler.quant import QUANT_FORMATS
from tallow.runtime.evaluate import evaluate, text_tokens
from tallow.runtime.manifest import Manifest
from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "prose.txt"
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1, "int8": 1, "uint32": 4}


def compile_artifact(model: Path, quant: str | None, out: Path, name: str) -> Path:
    fields = {f.name for f in dataclasses.fields(CompileOptions)}
    extra = {"allow_requantize": True} if "allow_requantize" in fields else {}
    options = CompileOptions(
        model=str(model), quant=quant, output=out, name=name, quiet=True, **extra
    )
    return Path(compile_model(options))


def artifact_size(folder: Path) -> tuple[int, float]:
    """Weight bytes and bits per weight over every parameter of an artifact."""
    manifest = Manifest.read(folder)
    total_bytes = total_weights = 0
    for p in manifest.params:
        count = int(np.prod(p.shape))
        total_bytes += count * _DTYPE_BYTES[p.dtype]
        if p.quant == "none":
            total_weights += count
        else:  # [rows, bytes per row] of blocks
            fmt = QUANT_FORMATS[p.quant]
            total_weights += count * fmt.block_size // fmt.type_size
    return total_bytes, total_bytes * 8 / total_weights


def gguf_size(path: Path) -> tuple[int, float]:
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    total_bytes = sum(int(t.n_bytes) for t in tensors)
    return total_bytes, total_bytes * 8 / sum(int(t.n_elements) for t in tensors)


def llama_ftype_name(quant: str) -> str:
    """llama.cpp's ftype for a tallow mix name: q4k_m -> Q4_K_M, q4k -> Q4_K_M, q2k -> Q2_K."""
    name = quant.lower().split(":")[0]
    k = re.fullmatch(r"q([2-6])_?k(?:_([sml]))?", name)
    if not k:
        return name.upper()
    bits, size = k.groups()
    if size is None and bits in "345":
        size = "m"  # llama-quantize reads Q3_K / Q4_K / Q5_K as their _M mixes
    return f"Q{bits}_K" + (f"_{size.upper()}" if size else "")


def llama_cpp_quantize(source: Path, ftype: str, out: Path) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    # F32 is LLAMA_FTYPE_ALL_F32; every other ftype LLAMA_FTYPE_MOSTLY_*
    params.ftype = getattr(
        llama_cpp,
        f"LLAMA_FTYPE_MOSTLY_{ftype}",
        getattr(llama_cpp, f"LLAMA_FTYPE_ALL_{ftype}", None),
    )
    params.allow_requantize = True
    params.nthread = 2
    dst = out / f"llama-cpp-{ftype}.gguf"
    # llama.cpp logs every tensor to fd 2: kept in a file, shown only when it fails.
    with tempfile.TemporaryFile() as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(
                str(source).encode(), str(dst).encode(), ctypes.byref(params)
            )
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if rc != 0:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"llama_model_quantize to {ftype} failed ({rc}):\n{tail}")
    return dst


@dataclasses.dataclass
class Row:
    mix: str
    made_by: str
    size: int
    bpw: float
    result: object  # EvalResult
    seconds: float
    note: str = ""


def run_eval(artifact: Path, reference: TVMModelRunner, tokens: list[int], context: int):
    runner = TVMModelRunner(artifact, kv=KVCacheConfig(1, context + 64))
    started = time.perf_counter()
    result = evaluate(runner, tokens, context, reference)
    return result, time.perf_counter() - started


def table(rows: list[Row]) -> str:
    head = (
        "| mix | made by | size (MiB) | bits/weight | perplexity | Δ ppl | KL mean | KL p99 "
        "| top-1 agreement |\n|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        e = r.result
        lines.append(
            f"| {r.mix} | {r.made_by} | {r.size / 2**20:.1f} | {r.bpw:.2f} | "
            f"{e.perplexity:.3f} | {e.delta_perplexity:+.3f} | {e.kl_mean:.4f} | "
            f"{e.kl_p99:.4f} | {100 * e.top1_agreement:.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, help="source GGUF (default: embedded SmolLM2)")
    ap.add_argument("--quant", nargs="+", default=["q8_0", "q6k", "q4k", "q4_0"])
    ap.add_argument("--text", type=Path, default=TEXT, help="prose to score (tests/data/prose.txt)")
    ap.add_argument("--context", type=int, default=512, help="tokens per window (512)")
    ap.add_argument("--tokens", type=int, default=0, help="cut the text to N tokens (0: all)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="tallow's mixes only")
    args = ap.parse_args()
    model = args.model or default_model_path()
    source_bytes, source_bpw = gguf_size(model)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
        say("compiling the f32 reference")
        reference = TVMModelRunner(
            compile_artifact(model, "f32", out, "f32"), kv=KVCacheConfig(1, args.context + 64)
        )
        tokens = text_tokens(reference, args.text.read_text())
        tokens = tokens[: args.tokens] if args.tokens else tokens
        for quant in args.quant:
            say(f"{quant}: tallow")
            art = compile_artifact(model, quant, out, quant)
            size, bpw = artifact_size(art)
            rows.append(
                Row(quant, "tallow", size, bpw, *run_eval(art, reference, tokens, args.context))
            )
            if args.no_llama_cpp:
                continue
            ftype = llama_ftype_name(quant)
            say(f"{quant}: llama.cpp {ftype}")
            gguf_path = llama_cpp_quantize(model, ftype, out)
            size, bpw = gguf_size(gguf_path)
            art = compile_artifact(gguf_path, None, out, f"llama-cpp-{ftype}")
            ran_bpw = artifact_size(art)[1]
            note = f"tallow ran it at {ran_bpw:.2f} bits/weight" if ran_bpw > bpw + 0.05 else ""
            result, seconds = run_eval(art, reference, tokens, args.context)
            rows.append(Row(ftype, "llama.cpp", size, bpw, result, seconds, note))
    first = rows[0].result
    requantized = "; every mix requantizes its dequantized weights" if source_bpw < 16 else ""
    print(
        f"{model.name} (source {source_bytes / 2**20:.1f} MiB, {source_bpw:.2f} bits/weight"
        f"{requantized}), {args.text.name}: "
        f"{first.tokens_scored} tokens scored in {first.windows} windows of {first.context}; "
        f"f32 reference perplexity {first.reference_perplexity:.3f}\n"
    )
    print(table(rows))
    for r in rows:
        if r.note:
            print(f"\n{r.mix} ({r.made_by}): {r.note}")
    print(f"\neval seconds per row: {', '.join(f'{r.mix} {r.seconds:.0f}' for r in rows)}")


if __name__ == "__main__":
    main()
