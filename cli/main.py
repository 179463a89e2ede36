"""`tallow`: the command line. The one place that wires the compiler and the runtime together.

Compile-side modules are imported only by the `compile` subcommand, so `generate` and
`inspect` run on a machine with the TVM runtime alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from tallow.cli.arg_types import device as device_arg
from tallow.cli.arg_types import positive_int
from tallow.cli.eval import add_eval_parser, run_eval
from tallow.cli.sampling_flags import add_sampling_flags, check_sampling_flags, sampling_defaults
from tallow.runtime.errors import TallowError


def quant_format_names() -> tuple[str, ...]:
    """The `--quant` names (floats, the mixes and aliases, FORMAT:all per block format)."""
    from tallow.compiler.quant_plan import quant_choices

    return quant_choices()


def _artifact(value: str):
    """argparse type of an artifact argument: a folder, or hf://org/repo[@revision]."""
    from tallow.cli.hub import artifact_arg

    return artifact_arg(value)


_ARTIFACT_HELP = "artifact folder written by `tallow compile`, or hf://org/repo[@revision]"


class _FormatList:
    """`--quant`'s names for its help text, read from the quant format registry only when
    the help is shown: the compile-side modules stay unimported for the other commands."""

    def __str__(self) -> str:
        return ", ".join(quant_format_names())


class _QuantOption(argparse.Action):
    """A plain store action whose help can say `%(formats)s` (checked by the compiler's
    `check_quant_option`, whose error lists the names)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.formats = _FormatList()

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


def _add_compile(sub) -> None:
    # The registry of compile targets; importing it loads no TVM (backends import it lazily).
    from tallow.compiler.backends import BACKENDS
    from tallow.compiler.cpu_levels import CPU_CHOICES

    p = sub.add_parser(
        "compile",
        help="compile a model into an artifact folder",
        description=(
            "Read a model (a local Hugging Face folder with config.json + safetensors, a GGUF "
            "file, a Hugging Face hub id, or 'default' for the embedded SmolLM2-135M-Instruct), "
            "compile it for a target with TVM, and write an artifact folder: the library, the "
            "weights, the tokenizer and a manifest."
        ),
    )
    p.add_argument(
        "--model",
        help="a local model folder, a .gguf file, a hub id such as Qwen/Qwen3-0.6B, or 'default' "
        "(required unless --add-target, which defaults to the artifact's source)",
    )
    p.add_argument(
        "--file",
        dest="gguf_file",
        help="with a hub id or folder holding several GGUF files: which .gguf file to use",
    )
    p.add_argument(
        "--target",
        action="append",
        choices=list(BACKENDS),
        help="compile target (default cpu); repeat for one artifact with a library per target "
        "sharing one copy of the weights",
    )
    p.add_argument(
        "--cpu",
        action="append",
        choices=CPU_CHOICES,
        metavar="LEVEL",
        help="with --target cpu: the CPUs the library runs on: native (this machine's CPU, the "
        f"default), {', '.join(CPU_CHOICES[1:])}; repeat for one library per level "
        "(the runtime loads the best one the running CPU supports)",
    )
    p.add_argument(
        "--add-target",
        type=Path,
        metavar="ARTIFACT",
        help="add the --target libraries to this existing artifact; its weights are not "
        "rewritten (the model source is read for its config only; dtype, weight formats, "
        "task and context window are the artifact's)",
    )
    p.add_argument(
        "--sm",
        "-sm",  # as nvcc-style tools and the user's card spell it
        type=int,
        action="append",
        dest="sms",
        help="with --target cuda: SM architecture to emit SASS for (80, 86, 89, 90, 100, 120); "
        "repeat for one library serving several GPUs (default 90)",
    )
    p.add_argument(
        "--dtype",
        choices=["f32", "f16", "bf16"],
        help="compute dtype of activations, norms and KV cache, and of float weights "
        "(default: the target's natural one: f32 on the CPU, f16 on Metal, on CUDA the "
        "model's torch_dtype bf16 or f16, f16 for GGUF and f32 models)",
    )
    p.add_argument(
        "--kv-dtype",
        help="dtype of the KV cache: f16, bf16 or f32 (default: the compute dtype); TVM "
        "0.27's paged cache holds no 8-bit cache (docs/gpu-artifacts.md)",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=16,
        help="tokens per KV cache page (16, the one size TVM 0.27's cache kernels take)",
    )
    p.add_argument(
        "--quant",
        action=_QuantOption,
        help=(
            "weights: %(formats)s. A float format, or a mix that picks a block format per "
            "tensor by role and layer as llama.cpp's quantize does (llama.cpp's names such as "
            "Q4_K_M are accepted too); q4k means q4k_m (and q3k q3k_m, q5k q5k_m). "
            "FORMAT:all (e.g. q4k:all) puts every weight, head included, in one format. "
            "Default: a GGUF keeps each tensor's own type; other sources use --dtype"
        ),
    )
    p.add_argument(
        "--allow-requantize",
        action="store_true",
        help="let --quant re-encode a GGUF's already quantized weights (loses precision twice; "
        "refused by default, as llama.cpp's quantize does)",
    )
    p.add_argument(
        "--output", type=Path, default=Path("artifacts"), help="parent folder (default artifacts/)"
    )
    p.add_argument("--name", help="artifact folder name (default <model>-<dtype>-<target>)")
    p.add_argument(
        "--context-window",
        type=int,
        help="cap the context window below the model's maximum (smaller KV cache)",
    )
    p.add_argument(
        "--task",
        choices=("generate", "embed"),
        default="generate",
        help=(
            "generate: text generation, and embeddings from the same artifact (default); "
            "embed: embeddings only (no decode functions, sampler or untied lm_head)"
        ),
    )
    p.add_argument(
        "--pooling",
        choices=("mean", "last"),
        help=(
            "how embeddings pool the hidden states (default: the source's "
            "1_Pooling/config.json, last token for *Embedding* models, else mean)"
        ),
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from an artifact",
        description=(
            "Load an artifact with the TVM runtime and generate text. The text goes to stdout "
            "as it is produced; token counts and speed go to stderr."
        ),
    )
    p.add_argument("artifact", type=_artifact, help=_ARTIFACT_HELP)
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", help="with --chat: a system message")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    add_sampling_flags(p, "the command line")
    p.add_argument("--seed", type=int, help="sampling seed, for reproducible output")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    _add_device(p)
    p.add_argument(
        "--threads", type=positive_int, help="CPU kernel threads (default: every usable CPU)"
    )


def _add_device(p) -> None:
    p.add_argument(
        "--device",
        type=device_arg,
        default="auto",
        help="auto (default: CUDA when a driver and a matching SASS arch exist, Metal on a Mac, "
        "else the best CPU library that fits), cpu, cuda[:N] or metal[:N]",
    )


def _add_inspect(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="print an artifact's manifest, or with --gpu its decode roofline",
        description=(
            "Print the manifest. With --gpu, print instead the bytes one decode step reads "
            "(weights once, the KV cache of every sequence) and the resulting upper bound on "
            "tok/s on that GPU (runtime/roofline.py)."
        ),
    )
    p.add_argument("artifact", type=_artifact, help=_ARTIFACT_HELP)
    from tallow.runtime.roofline import GPUS

    p.add_argument("--gpu", help=f"a GPU by name: {', '.join(GPUS)}")
    p.add_argument("--batch", type=int, default=1, help="sequences per decode step (default 1)")
    p.add_argument(
        "--context", type=int, default=512, help="positions each sequence attends to (512)"
    )


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check every file of an artifact against the checksums in its manifest",
        description=(
            "Hash every file the manifest records (weight shards, tokenizer files, chat "
            "template) and compare size and sha256. Exit status 0 when all match; 1 when a "
            "file is damaged or missing (each one is named), or when the artifact was compiled "
            "before checksums were recorded."
        ),
    )
    p.add_argument("artifact", type=_artifact, help=_ARTIFACT_HELP)


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an artifact over an OpenAI-compatible HTTP API",
        description=(
            "Serve an artifact with /v1/chat/completions, /v1/completions, /v1/models, "
            "/tokenize, /detokenize, /health and /metrics, and a chat page at / (unless "
            "--no-ui). Without ARTIFACT, the embedded default model is compiled for this host "
            "once (cached under artifacts/) and served."
        ),
    )
    p.add_argument(
        "artifact", type=_artifact, nargs="?", help=_ARTIFACT_HELP + " (default: see above)"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("TALLOW_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $TALLOW_API_KEY, else no auth)",
    )
    p.add_argument("--served-model-name", help="model name in the API (default: folder name)")
    p.add_argument("--no-ui", action="store_true", help="no chat page at / (the API only)")
    p.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host names to answer besides localhost names, IP addresses and "
        "the bind address ('*.example.com': its subdomains, '*': any); other Hosts get 400, "
        "which stops DNS-rebinding pages",
    )
    p.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated web origins whose pages may call the API (CORS; '*': any); "
        "default: none",
    )
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences per batch (16)")
    p.add_argument("--prefill-chunk-size", type=int, default=512, help="tokens (default 512)")
    p.add_argument("--kv-cache-mem", type=float, help="KV cache size in MB (default: by memory)")
    p.add_argument(
        "--gpu-memory-fraction",
        type=float,
        help="share of free memory for the KV cache (default 0.9 on GPUs, 0.25 of RAM on CPU)",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    p.add_argument("--prefix-cache-max-tokens", type=int, default=8192, help="(default 8192)")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant outputs: a request's tokens and logprobs do not depend on what "
        "else runs (turns the prefix cache off)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="waiting sequences (prompts x n) before 429 (256)",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=4 * 2**20, help="largest request body (4 MiB)"
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (default 30)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        help="seconds a client gets to send a whole request, headers and body (default 30)",
    )
    add_sampling_flags(p, "a request")
    _add_device(p)
    p.add_argument(
        "--threads", type=positive_int, help="CPU kernel threads (default: every usable CPU)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tallow",
        description="tallow: an ahead-of-time LLM compiler (Apache TVM) and serving runtime.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_compile(sub)
    add_eval_parser(sub)
    _add_generate(sub)
    _add_inspect(sub)
    _add_serve(sub)
    _add_verify(sub)
    from tallow.cli.hub import add_push

    add_push(sub)
    return parser


def _run_compile(args) -> int:
    from tallow.compiler.pipeline import CompileOptions, compile_model

    if args.add_target is not None:
        from tallow.compiler.add_target import add_targets

        print(add_targets(args.add_target, _add_target_options(args)))
        return 0
    if not args.model:
        raise TallowError("compile needs --model (or --add-target ARTIFACT)")
    out = compile_model(
        CompileOptions(
            model=args.model,
            gguf_file=args.gguf_file,
            target=args.target or ["cpu"],
            cpu=args.cpu,
            sms=args.sms,
            dtype=args.dtype,
            kv_dtype=args.kv_dtype,
            page_size=args.page_size,
            quant=args.quant,
            allow_requantize=args.allow_requantize,
            output=args.output,
            name=args.name,
            context_window=args.context_window,
            overwrite=args.overwrite,
            quiet=args.quiet,
            task=args.task,
            pooling=args.pooling,
        )
    )
    print(out)
    return 0


def _add_target_options(args):
    """What `--add-target` takes from the command line; the rest comes from the manifest."""
    from tallow.compiler.add_target import AddTargetOptions

    if not args.target:
        raise TallowError("--add-target needs at least one --target")
    return AddTargetOptions(
        targets=args.target,
        cpu=args.cpu,
        sms=args.sms,
        model=args.model,
        gguf_file=args.gguf_file,
        overwrite=args.overwrite,
        quiet=args.quiet,
    )


def _run_generate(args) -> int:
    from tallow.cli.generate import run_generate
    from tallow.cli.hub import artifact_folder

    args.artifact = artifact_folder(args.artifact, args.device)
    return run_generate(args)


def _run_inspect(args) -> int:
    from tallow.cli.hub import manifest_folder
    from tallow.runtime.manifest import Manifest

    manifest = Manifest.read(manifest_folder(args.artifact))
    if args.gpu is None:
        sys.stdout.write(manifest.to_yaml())
        return 0
    from tallow.runtime.roofline import decode_roofline

    print(decode_roofline(manifest, args.gpu, args.batch, args.context).describe())
    return 0


def _run_verify(args) -> int:
    from tallow.cli.hub import whole_artifact_folder
    from tallow.runtime.integrity import verify
    from tallow.runtime.manifest import Manifest

    folder = whole_artifact_folder(args.artifact)  # hf://: downloaded, checked below
    manifest = Manifest.read(folder)
    if manifest.checksums is None:
        print(
            f"{args.artifact}: no checksums recorded (compiled by an older tallow); "
            "recompile to be able to verify it",
            file=sys.stderr,
        )
        return 1
    results = verify(folder, manifest.checksums)
    bad = [(name, problem) for name, problem in results if problem is not None]
    for name, problem in results:
        print(f"{'ok ' if problem is None else 'BAD'} {name}" + (f": {problem}" if problem else ""))
    if bad:
        names = ", ".join(name for name, _ in bad)
        print(f"{args.artifact}: {len(bad)} damaged file(s): {names}", file=sys.stderr)
        return 1
    print(f"{args.artifact}: {len(results)} files verified", file=sys.stderr)
    return 0


def _run_push(args) -> int:
    from tallow.cli.hub import run_push

    return run_push(args)


_DEFAULT_ARTIFACT = Path("artifacts/smollm2-135m-instruct-q4_1-cpu")


def _run_serve(args) -> int:
    from tallow.server.listener import bind_listener

    # The port first: one that is taken is an error now, not after the model has loaded.
    listener = bind_listener(args.host, args.port)
    try:
        return _serve_on(args, listener)
    finally:
        listener.close()


def _serve_on(args, listener) -> int:
    folder = args.artifact
    if folder is None:
        folder = _DEFAULT_ARTIFACT
        if not (folder / "manifest.yaml").is_file():
            # The one case where serving needs the compiler: the first run without an artifact.
            from tallow.compiler.pipeline import CompileOptions, compile_model

            print(f"compiling the default model into {folder} (once)", file=sys.stderr)
            options = CompileOptions(model="default", output=folder.parent, name=folder.name)
            folder = Path(compile_model(options))
    else:
        from tallow.cli.hub import artifact_folder

        folder = artifact_folder(args.artifact, args.device)
    # Otherwise the server needs only TVM's runtime library, not the compiler stack.
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    from tallow.runtime.engine_factory import EngineOptions, build_engine
    from tallow.server.app import ServerOptions
    from tallow.server.launch import serve

    engine = build_engine(
        folder,
        EngineOptions(
            device=args.device,
            max_num_seqs=args.max_num_seqs,
            prefill_chunk_size=args.prefill_chunk_size,
            kv_cache_mem_mb=args.kv_cache_mem,
            memory_fraction=args.gpu_memory_fraction,
            prefix_cache=not args.no_prefix_cache,
            prefix_cache_max_tokens=args.prefix_cache_max_tokens,
            threads=args.threads,
            deterministic=args.deterministic,
        ),
    )
    try:
        _ = engine.model  # builds the chat template: a broken one fails here, before serving
    except ValueError as e:  # ChatTemplateError
        raise TallowError(f"{folder}: {e}") from e
    options = ServerOptions(
        api_key=args.api_key or None,
        max_queued_requests=args.max_queued_requests,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        ui=not args.no_ui,
        allowed_hosts=_comma_list(args.allowed_hosts),
        allowed_origins=_comma_list(args.allowed_origins),
        request_timeout=args.request_timeout,
        sampling_defaults=sampling_defaults(args, engine.model.sampling_defaults),
    )
    print(f"sampling defaults: {options.sampling_defaults.describe()}", file=sys.stderr)
    name = args.served_model_name or _served_name(args.artifact, folder)
    library = getattr(engine.runner, "library", None)  # which of the artifact's libraries
    if library is not None:
        print(f"library {library.file} ({library.target})", file=sys.stderr, flush=True)
    # Says "serving ..." once uvicorn serves on the listener.
    return serve(engine, name, options, args.host, args.port, listener)


def _served_name(spec, folder: Path) -> str:
    from tallow.cli.hub import served_name

    return served_name(spec, folder)


def _comma_list(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    commands = {
        "compile": _run_compile,
        "eval": run_eval,
        "generate": _run_generate,
        "inspect": _run_inspect,
        "serve": _run_serve,
        "verify": _run_verify,
        "push": _run_push,
    }
    try:
        if args.command in ("generate", "serve"):
            check_sampling_flags(args)
        return commands[args.command](args)
    except TallowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
