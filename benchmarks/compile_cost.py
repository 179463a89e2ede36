"""Compile time and peak memory for a model shape, without weights (lowering + codegen only).

    .venv/bin/python benchmarks/compile_cost.py                 # Qwen3-0.6B shape, f16, cpu
    .venv/bin/python benchmarks/compile_cost.py --layers 36 --hidden 4096 --heads 32 \
        --kv-heads 8 --head-dim 128 --ffn 12288 --vocab 151936  # Qwen3-8B shape

Prints seconds per phase and the peak resident memory of the process.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", default="f16")
    args = ap.parse_args()

    from tallow.compiler.relax_pipeline import build_module, lower_module
    from tallow.compiler.target import DTYPES, resolve_target
    from tallow.model_defs.registry import get_architecture

    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    }
    times = {}
    t = time.perf_counter()
    spec = resolve_target("cpu", args.dtype)
    arch = get_architecture(cfg)
    module = arch.build(arch.config_from_hf(cfg), DTYPES[args.dtype], spec.tvm())
    mod, params = module.export_tvm(spec=module.get_default_spec())
    times["build + export"] = time.perf_counter() - t
    t = time.perf_counter()
    mod = lower_module(mod, spec)
    times["lower (Relax pipeline + schedules)"] = time.perf_counter() - t
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        build_module(mod, spec, Path(d) / "model.so")
        size = (Path(d) / "model.so").stat().st_size
    times["codegen + link"] = time.perf_counter() - t
    n_params = sum(int(__import__("math").prod(p.shape)) for _, p in params)
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {n_params / 1e6:.0f}M params, "
        f"{args.dtype}, target cpu; library {size / 2**20:.1f} MiB"
    )
    for k, v in times.items():
        print(f"  {k:<36} {v:7.1f} s")
    print(f"  {'total':<36} {sum(times.values()):7.1f} s")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"  peak resident memory {peak:.2f} GiB")


if __name__ == "__main__":
    main()
