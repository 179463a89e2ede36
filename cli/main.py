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

from tallow.cli.arg_types import THREADS_HELP, add_device, positive_int
from tallow.cli.eval import add_eval_parser, run_eval
from tallow.cli.inspect import add_inspect_parser, run_inspect
from tallow.cli.sampling_flags import add_sampling_flags, check_sampling_flags
from tallow.cli.serve import add_serve_parser, run_serve
from tallow.cli.speculative_flags import add_speculative_flags
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
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="split attention heads and the MLP across N workers (a power of two dividing the "
        "KV heads); generate/serve start N Disco workers (docs/tensor-parallel.md)",
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
    p.add_argument(
        "--name",
        help="artifact folder name (default <model>-<weights>-<targets>, e.g. "
        "smollm2-135m-instruct-q4_1-cpu; -embed added with --task embed)",
    )
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
    add_speculative_flags(p)
    add_device(p)
    p.add_argument("--threads", type=positive_int, help=THREADS_HELP)


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


def _add_build_nccl(sub) -> None:
    p = sub.add_parser(
        "build-nccl",
        help="build tallow's NCCL module, the collective CUDA tensor parallelism runs on",
        description=(
            "Compile runtime/native/disco_nccl.cc with the host C++ compiler against the TVM "
            "wheel's headers and PyPI's NCCL and CUDA 13 runtime (pip install 'tallow[cuda]'), "
            "into the cache ($TALLOW_CACHE_DIR, else ~/.cache/tallow). Needed once per install "
            "before serving a CUDA artifact compiled with --tensor-parallel; no GPU is needed "
            "to build it. Prints the library's path."
        ),
    )
    p.add_argument("--force", action="store_true", help="rebuild even when it is built")


def _run_build_nccl(args) -> int:
    from tallow.runtime import nccl_module

    print(nccl_module.build(force=args.force))
    return 0


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
    add_inspect_parser(sub, _artifact, _ARTIFACT_HELP)
    add_serve_parser(sub, _artifact, _ARTIFACT_HELP)
    _add_verify(sub)
    _add_build_nccl(sub)
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
            tensor_parallel=args.tensor_parallel,
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
        "inspect": run_inspect,
        "serve": run_serve,
        "verify": _run_verify,
        "push": _run_push,
        "build-nccl": _run_build_nccl,
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
    except BrokenPipeError:  # `tallow inspect ... | head`: the reader left; nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
