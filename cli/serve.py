"""`tallow serve`: its options, the default model's cache, and the start-up order (the port
first, then the model, then the app)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

from tallow.cli.arg_types import THREADS_HELP, add_device, positive_int
from tallow.cli.sampling_flags import add_sampling_flags, sampling_defaults
from tallow.cli.serve_ray import add_replica_flags, run_ray_serve, wants_ray
from tallow.cli.speculative_flags import add_speculative_flags, speculative_config
from tallow.runtime.errors import TallowError
from tallow.server.paths import routes_help


def add_serve_parser(sub, artifact_type, artifact_help: str) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an artifact over an OpenAI-compatible HTTP API",
        description=textwrap.fill(
            "Serve an artifact over HTTP, at the routes listed below (docs/api.md describes "
            "them). Without ARTIFACT, the embedded default model is compiled for this host "
            f"once, into ${CACHE_ENV} (default $XDG_CACHE_HOME/tallow or ~/.cache/tallow), "
            "and served.",
            width=78,
        ),
        epilog="routes:\n" + routes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "artifact", type=artifact_type, nargs="?", help=artifact_help + " (default: see above)"
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
    add_speculative_flags(p)
    add_device(p)
    p.add_argument("--threads", type=positive_int, help=THREADS_HELP)
    add_replica_flags(p)


DEFAULT_ARTIFACT_NAME = "smollm2-135m-instruct-q4_1-cpu"
CACHE_ENV = "TALLOW_CACHE_DIR"


def cache_dir() -> Path:
    """Where `tallow serve` keeps what it compiles for itself (the default model): the
    folder $TALLOW_CACHE_DIR names, else $XDG_CACHE_HOME/tallow, else ~/.cache/tallow (where
    Hugging Face keeps ~/.cache/huggingface). Once per user, not an `artifacts/` folder in
    every working directory."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tallow"


def default_artifact() -> Path:
    return cache_dir() / DEFAULT_ARTIFACT_NAME


def run_serve(args) -> int:
    from tallow.server.listener import bind_listener

    if wants_ray(args):  # replicas on Ray Serve, which binds the port itself
        folder = _artifact(args)
        return run_ray_serve(
            args, folder, args.served_model_name or _served_name(args.artifact, folder)
        )

    # The port first: one that is taken is an error now, not after the model has loaded.
    listener = bind_listener(args.host, args.port)
    try:
        return _serve_on(args, listener)
    finally:
        listener.close()


def _artifact(args) -> Path:
    """The artifact's folder: ARTIFACT's (pulled when on the hub), else the default model's,
    compiled on first use."""
    folder = args.artifact
    if folder is None:
        folder = default_artifact()
        if not (folder / "manifest.yaml").is_file():
            # The one case where serving needs the compiler: the first run without an artifact.
            from tallow.compiler.pipeline import CompileOptions, compile_model

            print(f"compiling the default model into {folder} (once)", file=sys.stderr)
            options = CompileOptions(
                model="default", output=folder.parent, name=folder.name, overwrite=True
            )
            folder = Path(compile_model(options))
    else:
        from tallow.cli.hub import artifact_folder

        folder = artifact_folder(args.artifact, args.device)
    return folder


def _serve_on(args, listener) -> int:
    speculative = speculative_config(args)  # a bad value is reported before the model loads
    folder = _artifact(args)
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
            speculative=speculative,
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
