"""Compile a model *shape* (no weights) for a target and time the phases.

    python benchmarks/compile_shape.py --preset qwen3-8b --target cuda --sm 90 --dtype f16 \
        --out /tmp/q8
    python benchmarks/compile_shape.py --preset qwen3-0.6b --target cpu --dtype f16 --out /tmp/q06

Writes `<out>/lib/<target>.so` (a .tar for metal) and `<out>/shape.json` (config, parameter
names/shapes/dtypes in library order, target details), which `gpu_check.py` uses to make
random weights on the GPU machine. Used for compile-time numbers and for the GPU check.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PRESETS = {
    # Small enough to check logits CUDA vs CPU quickly, wide enough for tensor cores.
    "qwen3-small": dict(
        QWEN3,
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    "qwen3-0.6b": dict(
        QWEN3,
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b-2l": dict(
        QWEN3,
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        QWEN3,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
}


def compile_shape(hf_config: dict, target: str, dtype: str, out: Path, sms=None) -> dict:
    """Build, export, lower and build `hf_config` for `target`; return timings + details."""
    from tallow.compiler.relax_pipeline import lower_module
    from tallow.compiler.sampler_function import add_sampler_function
    from tallow.compiler.target import DTYPES, BuildReport, resolve_target
    from tallow.model_defs.registry import get_architecture

    out.mkdir(parents=True, exist_ok=True)
    times, t0 = {}, time.perf_counter()
    spec = resolve_target(target, dtype, sms)
    if spec.kind == "cpu":  # generic x86-64: the reference must run on any machine's CPU
        spec.tvm_target, spec.report = {"kind": "llvm"}, BuildReport(mcpu="generic")
    arch = get_architecture(hf_config)
    config = arch.config_from_hf(hf_config)
    module = arch.build(config, DTYPES[dtype], spec.tvm())
    ir_module, params = module.export_tvm(spec=module.get_default_spec())
    ir_module = add_sampler_function(ir_module, config.vocab_size, spec.backend)
    times["export_s"] = round(time.perf_counter() - t0, 1)
    t = time.perf_counter()
    lowered = lower_module(ir_module, spec)
    times["lower_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    (out / spec.library_name).parent.mkdir(parents=True, exist_ok=True)
    spec.backend.build(lowered, spec, out / spec.library_name)
    times["build_s"] = round(time.perf_counter() - t, 1)
    times["total_s"] = round(time.perf_counter() - t0, 1)
    times["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    info = {
        "config": hf_config,
        "dtype": DTYPES[dtype],
        "library": spec.library_name,
        "target": {"kind": spec.kind, "details": spec.report.to_details()},
        "params": [[n, [int(d) for d in p.shape], str(p.dtype)] for n, p in params],
        "times": times,
    }
    (out / "shape.json").write_text(json.dumps(info, indent=1))
    return info


def main() -> None:
    from tallow.compiler.backends import BACKENDS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--target", default="cuda", choices=list(BACKENDS))
    ap.add_argument("--sm", type=int, action="append", dest="sms")
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    info = compile_shape(PRESETS[args.preset], args.target, args.dtype, args.out, args.sms)
    tc = info["target"]["details"].get("schedules", {}).get("tensor_core", {})
    print(json.dumps({"times": info["times"], "tensorized": len(tc.get("tensorized_kernels", []))}))


if __name__ == "__main__":
    main()
