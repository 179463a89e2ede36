"""Compile a model *shape* (no weights) for a target and time the phases.

    python benchmarks/compile_shape.py --preset qwen3-8b --target cuda --sm 90 --dtype f16 \
        --out /tmp/q8
    python benchmarks/compile_shape.py --preset qwen3-0.6b --target cpu --dtype f16 --out /tmp/q06

Writes the library where an artifact keeps it (`<out>/lib/cpu-znver4.so`, a .dylib or .tar
for metal: `TargetSpec.library_name`) and `<out>/shape.json` (config, parameter
names/shapes/dtypes in library order, target details). Used for compile-time numbers and for
the GPU check. `--quant q4k` gives every matrix (embedding and head included) GGUF q4k blocks
(uniform, unlike llama.cpp's q4k_m mix). `--artifact` also writes a manifest and a tokenizer
that name weight shards which do not exist yet: `gpu_check_run.py fill` writes random ones on
the GPU machine, after which the folder is an artifact `TVMModelRunner` and the engine load.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np

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


def uniform_quant(arch, config, dtype: str, target, qtype: str) -> dict[str, str]:
    """Every 2-D weight of the module (norms and biases stay float) in `qtype` blocks."""
    plain = arch.build(config, dtype, target)
    return {
        name: qtype
        for name, p in plain.named_parameters()
        if len(p.shape) == 2 and name.endswith(".weight")
    }


def compile_shape(
    hf_config: dict,
    target: str,
    dtype: str,
    out: Path,
    sms=None,
    quant: str | None = None,
    decode_buckets: tuple[int, ...] | None = None,
) -> dict:
    """Build, export, lower and build `hf_config` for `target`; return timings + details.
    `decode_buckets`: the static-row batch decodes to export (None: the backend's own)."""
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
    types = uniform_quant(arch, config, DTYPES[dtype], spec.tvm(), quant) if quant else {}
    module = arch.build(config, DTYPES[dtype], spec.tvm(), quant=types)
    functions = module.get_default_spec()
    # The backend's static-row batch decodes (CUDA: one per graph bucket), as `tallow compile`
    buckets = spec.backend.static_decode_buckets() if decode_buckets is None else decode_buckets
    bucket_spec = module.decode_bucket_spec(buckets)
    spec.report.static_decode_functions = (
        dict(zip(map(str, buckets), bucket_spec, strict=True)) or None
    )
    ir_module, params = module.export_tvm(spec={**functions, **bucket_spec})
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
        "quant": quant or "none",
        "library": spec.library_name,
        "target": {"kind": spec.kind, "details": spec.report.to_details()},
        "params": [[n, [int(d) for d in p.shape], str(p.dtype)] for n, p in params],
        "param_quant": {n: types.get(n, "none") for n, _ in params},
        "functions": [*functions, "sample_tokens"],
        "times": times,
    }
    info["_spec"] = spec
    spec = info.pop("_spec")
    (out / "shape.json").write_text(json.dumps(info, indent=1))
    info["_spec"] = spec
    return info


def write_skeleton(info: dict, out: Path, shard_bytes: int = 2 << 30) -> None:
    """A manifest (weights not written yet: no checksums) and a small byte-level tokenizer."""
    import importlib.metadata
    import sys

    from tallow.compiler.libraries import library_info
    from tallow.runtime.manifest import (
        FORMAT_VERSION,
        KVCacheInfo,
        Manifest,
        ManifestModel,
        ParamInfo,
        TokenizerInfo,
    )

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import make_tokenizer

    cfg = info["config"]
    make_tokenizer(out, 320)  # ids 0..319: within any vocabulary here
    params, shard, size = [], 0, 0
    for name, shape, dtype in info["params"]:
        nbytes = int(np.prod(shape)) * {"uint8": 1, "float16": 2, "bfloat16": 2}.get(dtype, 4)
        if size and size + nbytes > shard_bytes:
            shard, size = shard + 1, 0
        size += nbytes
        quant = info["param_quant"][name]
        params.append(ParamInfo(name, shape, dtype, f"params_{shard:05d}.safetensors", quant))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        tallow_version=importlib.metadata.version("tallow"),
        tvm_version=importlib.metadata.version("apache-tvm"),
        model=ManifestModel(
            name=out.name,
            architecture=cfg["architectures"][0],
            source="benchmarks/compile_shape.py (random weights)",
            source_kind="shape",
            source_files={},
            config=cfg,
        ),
        dtype=info["dtype"],
        quantization=info["quant"],
        kv_cache=KVCacheInfo(
            page_size=16,
            dtype=info["dtype"],
            context_window=cfg["max_position_embeddings"],
            num_layers=cfg["num_hidden_layers"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=head_dim,
        ),
        libraries=[library_info(info["_spec"])],
        functions=info["functions"],
        params=params,
        tokenizer=TokenizerInfo(
            files=["tokenizer.json"],
            bos_token_id=None,
            eos_token_ids=[2],
            add_bos_token=False,
            chat_template=None,
        ),
    )
    manifest.write(out)


def main() -> None:
    from tallow.compiler.backends import BACKENDS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--target", default="cuda", choices=list(BACKENDS))
    ap.add_argument("--sm", type=int, action="append", dest="sms")
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--quant", help="GGUF block type for every matrix (e.g. q4k)")
    ap.add_argument("--artifact", action="store_true", help="also write manifest + tokenizer")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    info = compile_shape(
        PRESETS[args.preset], args.target, args.dtype, args.out, args.sms, args.quant
    )
    if args.artifact:
        write_skeleton(info, args.out)
    tc = info["target"]["details"].get("schedules", {}).get("tensor_core", {})
    print(json.dumps({"times": info["times"], "tensorized": len(tc.get("tensorized_kernels", []))}))


if __name__ == "__main__":
    main()
