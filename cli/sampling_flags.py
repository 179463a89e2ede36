"""The sampling flags `tallow generate` and `tallow serve` share: defaults for the fields a
request leaves unset, over the model's own (`runtime/sampling_defaults.py`).

vLLM's counterparts: `--generation-config auto|vllm` is `--sampling-defaults model|openai`;
`--override-generation-config '{"temperature": 0.5}'` is `--temperature 0.5`.
"""

from __future__ import annotations

import argparse

from tallow.runtime.sampling_defaults import NEUTRAL, SamplingDefaults, check_values

# flag -> SamplingDefaults field
FLAGS = {
    "--temperature": "temperature",
    "--top-p": "top_p",
    "--top-k": "top_k",
    "--min-p": "min_p",
    "--repetition-penalty": "repetition_penalty",
}


def add_sampling_flags(p: argparse.ArgumentParser, what: str) -> None:
    """`what`: what leaves fields unset ("the command line", "a request")."""
    p.add_argument(
        "--sampling-defaults",
        choices=("model", "openai"),
        default="model",
        help=f"the values of sampling fields that {what} leaves unset: model (default: the "
        "model's own, from its generation_config.json or GGUF, as the manifest records them; "
        "`tallow inspect` shows them) or openai (temperature 1, top_p 1, no top_k, min_p or "
        "repetition penalty)",
    )
    helps = {
        "--temperature": "0 is greedy",
        "--top-p": "nucleus sampling mass",
        "--top-k": "keep the k most likely (0: off)",
        "--min-p": "drop tokens below this share of the top one's probability (0: off)",
        "--repetition-penalty": "1: off",
    }
    for flag, name in FLAGS.items():
        p.add_argument(
            flag,
            type=int if name == "top_k" else float,
            help=f"{helps[flag]} (default: see --sampling-defaults)",
        )


def check_sampling_flags(args: argparse.Namespace) -> None:
    """Range checks of the flags given, before anything slow is loaded."""
    for flag, name in FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            check_values({name: value}, flag)


def sampling_defaults(args: argparse.Namespace, model: SamplingDefaults) -> SamplingDefaults:
    """The defaults in force: the model's (or OpenAI's), with the flags given put over them."""
    base = model if args.sampling_defaults == "model" else NEUTRAL
    return base.overridden("command line", **_given(args))


def _given(args: argparse.Namespace) -> dict[str, float | int]:
    values = {name: getattr(args, name) for name in FLAGS.values()}
    return {name: v for name, v in values.items() if v is not None}
