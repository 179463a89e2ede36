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

from tallow.runtime.errors import TallowError


def quant_format_names() -> tuple[str, ...]:
    """The `--quant` names (floats, then the registered block formats)."""
    from tallow.compiler.quant_plan import quant_choices

    return quant_choices()


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
        required=True,
        help="a local model folder, a .gguf file, a hub id such as Qwen/Qwen3-0.6B, or 'default'",
    )
    p.add_argument(
        "--file",
        dest="gguf_file",
        help="with a hub id or folder holding several GGUF files: which .gguf file to use",
    )
    p.add_argument(
        "--target",
        default="cpu",
        choices=list(BACKENDS),
        help="compile target (default cpu)",
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
        default="f32",
        choices=["f32", "f16", "bf16"],
        help="compute dtype of activations and KV cache, and of float weights (default f32)",
    )
    p.add_argument(
        "--quant",
        action=_QuantOption,
        help=(
            "weight format: %(formats)s (floats, then block formats laid out as in GGUF). "
            "Default: a GGUF keeps each tensor's own type; other sources use --dtype"
        ),
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
    p.add_argument("artifact", type=Path, help="artifact folder written by `tallow compile`")
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", help="with --chat: a system message")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0: off)")
    p.add_argument("--seed", type=int, help="sampling seed, for reproducible output")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    p.add_argument("--device", help="cpu, cuda:N or metal:N (default: the artifact's kind)")
    p.add_argument("--threads", type=int, help="CPU kernel threads (default: every usable CPU)")


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="print an artifact's manifest")
    p.add_argument("artifact", type=Path)


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
    p.add_argument("artifact", type=Path, help="artifact folder written by `tallow compile`")


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
    p.add_argument("artifact", type=Path, nargs="?", help="artifact folder (default: see above)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
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
    p.add_argument("--device", help="cpu, cuda:N or metal:N (default: the artifact's kind)")
    p.add_argument("--threads", type=int, help="CPU kernel threads (default: every usable CPU)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tallow",
        description="tallow: an ahead-of-time LLM compiler (Apache TVM) and serving runtime.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_compile(sub)
    _add_generate(sub)
    _add_inspect(sub)
    _add_serve(sub)
    _add_verify(sub)
    return parser


def _run_compile(args) -> int:
    from tallow.compiler.pipeline import CompileOptions, compile_model

    out = compile_model(
        CompileOptions(
            model=args.model,
            gguf_file=args.gguf_file,
            target=args.target,
            sms=args.sms,
            dtype=args.dtype,
            quant=args.quant,
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


def _run_generate(args) -> int:
    from tallow.cli.generate import run_generate

    return run_generate(args)


def _run_inspect(args) -> int:
    from tallow.runtime.manifest import Manifest

    sys.stdout.write(Manifest.read(args.artifact).to_yaml())
    return 0


def _run_verify(args) -> int:
    from tallow.runtime.integrity import verify
    from tallow.runtime.manifest import Manifest

    manifest = Manifest.read(args.artifact)
    if manifest.checksums is None:
        print(
            f"{args.artifact}: no checksums recorded (compiled by an older tallow); "
            "recompile to be able to verify it",
            file=sys.stderr,
        )
        return 1
    results = verify(args.artifact, manifest.checksums)
    bad = [(name, problem) for name, problem in results if problem is not None]
    for name, problem in results:
        print(f"{'ok ' if problem is None else 'BAD'} {name}" + (f": {problem}" if problem else ""))
    if bad:
        names = ", ".join(name for name, _ in bad)
        print(f"{args.artifact}: {len(bad)} damaged file(s): {names}", file=sys.stderr)
        return 1
    print(f"{args.artifact}: {len(results)} files verified", file=sys.stderr)
    return 0


_DEFAULT_ARTIFACT = Path("artifacts/smollm2-135m-instruct-q4_1-cpu")


def _run_serve(args) -> int:
    folder = args.artifact
    if folder is None:
        folder = _DEFAULT_ARTIFACT
        if not (folder / "manifest.yaml").is_file():
            # The one case where serving needs the compiler: the first run without an artifact.
            from tallow.compiler.pipeline import CompileOptions, compile_model

            print(f"compiling the default model into {folder} (once)", file=sys.stderr)
            options = CompileOptions(model="default", output=folder.parent, name=folder.name)
            folder = Path(compile_model(options))
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
    )
    name = args.served_model_name or Path(folder).resolve().name
    print(f"serving {name} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    return serve(engine, name, options, args.host, args.port)


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
        "generate": _run_generate,
        "inspect": _run_inspect,
        "serve": _run_serve,
        "verify": _run_verify,
    }
    try:
        return commands[args.command](args)
    except TallowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
