"""`tallow inspect`: what an artifact holds, in a dozen lines (`--full`: the whole manifest,
about 1,350 lines for SmolLM2), or with `--gpu` its decode roofline on a named GPU; with
`--tensor-parallel N`, each step's all-reduce traffic at N workers (and with `--gpu`, its
time next to the weight streaming time: runtime/tp_estimate.py)."""

from __future__ import annotations

import math
import sys

from tallow.runtime.manifest import DTYPE_BYTES, Manifest

GPU_DEVICES = ("cuda", "metal")


def add_inspect_parser(sub, artifact_type, artifact_help: str) -> None:
    from tallow.runtime.roofline import GPUS

    p = sub.add_parser(
        "inspect",
        help="summarise an artifact (--full: its manifest), or with --gpu its decode roofline",
        description=(
            "Print what the artifact holds: the model, its weights, KV cache, libraries and "
            "sampling defaults (--full: the whole manifest). With --gpu, print instead the "
            "bytes one decode step reads (weights once, the KV cache of every sequence) and "
            "the resulting upper bound on tok/s on that GPU (runtime/roofline.py)."
        ),
    )
    p.add_argument("artifact", type=artifact_type, help=artifact_help)
    p.add_argument("--full", action="store_true", help="print the whole manifest (YAML)")
    p.add_argument(
        "--gpu",
        help=f"a GPU by name: {', '.join(GPUS)} (loosely: H100, a100, 4090 are understood)",
    )
    p.add_argument("--batch", type=int, default=1, help="sequences per decode step (default 1)")
    p.add_argument(
        "--context", type=int, default=512, help="positions each sequence attends to (512)"
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        help="print the all-reduces N workers make per step (count, bytes; with --gpu, an "
        "estimated time next to the weight streaming time at N and at 1 GPU); the artifact "
        "may be compiled for one worker",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=512,
        help="tokens of the prefill step --tensor-parallel sizes (512)",
    )


def run_inspect(args) -> int:
    from tallow.cli.hub import manifest_folder

    manifest = Manifest.read(manifest_folder(args.artifact))
    if args.tensor_parallel is not None:
        from tallow.runtime.tp_estimate import tp_estimate

        n = args.tensor_parallel
        estimate = tp_estimate(
            manifest, n, _split_rule(manifest, n), args.batch, args.prefill, args.gpu, args.context
        )
        print(estimate.describe())
        return 0
    if args.gpu is not None:
        from tallow.runtime.roofline import decode_roofline

        roofline = decode_roofline(manifest, args.gpu, args.batch, args.context)
        if not any(lib.device in GPU_DEVICES for lib in manifest.libraries):
            has = ", ".join(lib.target for lib in manifest.libraries)
            print(
                f"note: this artifact has no GPU library (it has: {has}); the figures are "
                "for these weights compiled for that GPU (tallow compile --add-target ... "
                "--target cuda)",
                file=sys.stderr,
            )
        print(roofline.describe())
        return 0
    sys.stdout.write(manifest.to_yaml() if args.full else summary(manifest))
    return 0


def _split_rule(manifest: Manifest, n: int):
    """Which weights N workers divide: the artifact's own rules when it was compiled for
    tensor parallelism, else the compiler's (which also refuse a degree the model cannot be
    split by, in one line)."""
    if manifest.tensor_parallel is not None:
        return set(manifest.tensor_parallel.shards).__contains__
    from tallow.model_defs.config import DecoderConfig
    from tallow.model_defs.config_fields import ConfigError
    from tallow.model_defs.tensor_parallel import check_degree, is_split
    from tallow.runtime.errors import ArtifactError

    try:
        config = DecoderConfig(**manifest.model.config)
    except TypeError:  # a manifest from another tallow: the split rules need no config
        config = None
    if config is not None:
        quant = {p.name: p.quant for p in manifest.params if p.quant != "none"}
        try:
            check_degree(config, n, quant)
        except ConfigError as e:
            raise ArtifactError(str(e)) from e
    return is_split


_ITEMSIZE = {**DTYPE_BYTES, "uint8": 1, "int8": 1, "int32": 4}


def summary(m: Manifest) -> str:
    """The facts a user looks for, one line each."""
    weight_bytes = sum(math.prod(p.shape) * _ITEMSIZE.get(p.dtype, 0) for p in m.params)
    shards = sorted({p.shard for p in m.params})
    kv = m.kv_cache
    lines = [
        f"model: {m.model.name} ({m.model.architecture}), task {m.task}",
        f"source: {m.model.source} ({m.model.source_kind})",
        f"weights: {m.quantization}, {len(m.params)} tensors, {weight_bytes / 2**20:.1f} MiB "
        f"in {len(shards)} shard(s); compute dtype {m.dtype} ({m.dtype_source})",
        f"KV cache: {kv.dtype}, pages of {kv.page_size} tokens, context window "
        f"{kv.context_window} tokens"
        + (f", {kv.bytes_per_token():,} bytes/token" if kv.num_layers else ""),
        "libraries:",
        *(f"  {lib.file}: {lib.target} ({lib.platform})" for lib in m.libraries),
        f"sampling defaults: {m.sampling_defaults.describe()}",
        f"tokenizer: {', '.join(m.tokenizer.files)}; chat template: "
        + (m.tokenizer.chat_template or "none"),
    ]
    if m.tensor_parallel is not None:
        tp = m.tensor_parallel
        lines.append(
            f"tensor parallel: {tp.degree} workers, {len(tp.shards)} tensors split at load "
            "(docs/tensor-parallel.md)"
        )
    if m.embedding is not None:
        e = m.embedding
        lines.append(f"embeddings: {e.dimensions} dimensions, {e.pooling} pooling")
    checks = "none recorded" if m.checksums is None else f"{len(m.checksums)} files"
    lines += [
        f"checksums: {checks} (tallow verify checks them)",
        f"built by tallow {m.tallow_version} with TVM {m.tvm_version}; --full prints the "
        "whole manifest",
    ]
    return "\n".join(lines) + "\n"
