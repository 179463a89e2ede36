"""Perplexity of SmolLM2-135M-Instruct on tests/data/prose.txt in several weight formats, all
requantized from the same source weights (the GGUF's Q4_1 blocks dequantized to f32).

    .venv/bin/python benchmarks/perplexity.py [--formats f32 q8_0 q6k q4k q4_0] [--tokens N]
        [--decode]

Prints a table: format, bits per weight of the linear weights, perplexity, ratio to f32.
By default the logits come from prefill (every position in one pass, float activations).
`--decode` also feeds the text one token at a time through the decode kernels (on x86 with
AVX2: int8 activations for quantized weights) and prints that perplexity next to it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import yaml

from tallow.compiler.default_model import default_model_path
from tallow.compiler.pipeline import CompileOptions, compile_model
from tallow.runtime.evaluate import perplexity
from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "prose.txt"


def bits_per_weight(artifact: Path) -> float:
    manifest = yaml.safe_load((artifact / "manifest.yaml").read_text())
    params = [p for p in manifest["params"] if p["name"].endswith("proj.weight")]
    total_bytes = sum(
        p["shape"][0] * p["shape"][1] * (1 if p["dtype"] == "uint8" else 4) for p in params
    )
    # weights from the model config: every projection is out_features x in_features
    cfg = manifest["model"]["config"]
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * f + f * h
    total_weights = per_layer * cfg["num_hidden_layers"]
    return total_bytes * 8 / total_weights


def decode_perplexity(runner: TVMModelRunner, tokens: list[int]) -> float:
    """Perplexity with every prediction made by a decode step (one token per call)."""
    runner.add_sequence(0)
    nll = 0.0
    try:
        for i, token in enumerate(tokens[:-1]):
            logits = runner.forward([(0, [token])])[0].astype(np.float64)
            top = logits.max()
            log_z = top + np.log(np.exp(logits - top).sum())
            nll += log_z - logits[tokens[i + 1]]
    finally:
        runner.remove_sequence(0)
    return float(np.exp(nll / (len(tokens) - 1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", nargs="+", default=["f32", "q8_0", "q6k", "q4k", "q4_0"])
    ap.add_argument("--tokens", type=int, default=0, help="cut the text to N tokens (0: all)")
    ap.add_argument("--decode", action="store_true", help="also measure through decode steps")
    args = ap.parse_args()
    model = default_model_path()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats:
            art = compile_model(
                # the source is the shipped Q4_1 file: requantizing it is the point here
                CompileOptions(
                    model=str(model),
                    quant=fmt,
                    allow_requantize=True,
                    output=Path(tmp),
                    quiet=True,
                )
            )
            runner = TVMModelRunner(art, kv=KVCacheConfig(1, 8192, 512))
            tokens = runner.tokenizer.tokenizer.encode(TEXT.read_text()).ids
            tokens = tokens[: args.tokens] if args.tokens else tokens
            decoded = decode_perplexity(runner, tokens) if args.decode else float("nan")
            rows.append(
                (fmt, bits_per_weight(art), perplexity(runner, tokens), len(tokens), decoded)
            )
    base = rows[0][2]
    print(f"SmolLM2-135M-Instruct, {rows[0][3]} tokens of tests/data/prose.txt")
    print(f"{'format':>7} {'bits/w':>7} {'ppl':>8} {'vs ' + rows[0][0]:>8} {'decode ppl':>10}")
    for fmt, bpw, ppl, _, decoded in rows:
        print(f"{fmt:>7} {bpw:>7.2f} {ppl:>8.3f} {ppl / base:>8.4f} {decoded:>10.3f}")


if __name__ == "__main__":
    main()
