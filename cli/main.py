"""`tallow`: the command line. The one place that wires the compiler and the runtime together.

Compile-side modules are imported only by the `compile` subcommand, so `generate` and
`inspect` run on a machine with the TVM runtime alone.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tallow.runtime.errors import TallowError


def _add_compile(sub) -> None:
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
    p.add_argument("--target", default="cpu", choices=["cpu"], help="compile target (default cpu)")
    p.add_argument(
        "--dtype",
        default="f32",
        choices=["f32", "f16", "bf16"],
        help="compute dtype of activations, weights and KV cache (default f32)",
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


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="print an artifact's manifest")
    p.add_argument("artifact", type=Path)


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
    return parser


def _run_compile(args) -> int:
    from tallow.compiler.pipeline import CompileOptions, compile_model

    out = compile_model(
        CompileOptions(
            model=args.model,
            gguf_file=args.gguf_file,
            target=args.target,
            dtype=args.dtype,
            output=args.output,
            name=args.name,
            context_window=args.context_window,
            overwrite=args.overwrite,
            quiet=args.quiet,
        )
    )
    print(out)
    return 0


def _run_generate(args) -> int:
    from tallow.runtime.cli_generate import run_generate

    return run_generate(args)


def _run_inspect(args) -> int:
    from tallow.runtime.manifest import Manifest

    sys.stdout.write(Manifest.read(args.artifact).to_yaml())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    commands = {"compile": _run_compile, "generate": _run_generate, "inspect": _run_inspect}
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
