"""The speculative-decoding flags `tallow serve` and `tallow generate` share."""

from __future__ import annotations

from pathlib import Path

from tallow.cli.arg_types import positive_int
from tallow.runtime.errors import TallowError
from tallow.runtime.speculative import KINDS, SpeculativeConfig


def add_speculative_flags(p) -> None:
    p.add_argument(
        "--speculative",
        choices=KINDS,
        help="speculative decoding: ngram proposes the continuation of the latest earlier "
        "occurrence of the last tokens (prompt lookup), draft a smaller model's guesses "
        "(--draft); the model verifies them in one forward and keeps what it agrees with, so "
        "outputs are those it would sample anyway (default: off)",
    )
    p.add_argument(
        "--draft",
        metavar="ARTIFACT",
        help="with --speculative draft: the draft model's artifact folder (the model's "
        "tokenizer, fewer weights)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=SpeculativeConfig.num_speculative_tokens,
        help="with --speculative: the most tokens proposed per sequence per step (default "
        f"{SpeculativeConfig.num_speculative_tokens}; fewer as acceptance falls or batches grow)",
    )


def speculative_config(args) -> SpeculativeConfig | None:
    if not args.speculative:
        if args.draft:
            raise TallowError("--draft goes with --speculative draft")
        return None
    if args.draft and not (Path(args.draft) / "manifest.yaml").is_file():
        raise TallowError(f"--draft {args.draft}: not an artifact folder (no manifest.yaml)")
    try:
        return SpeculativeConfig(
            kind=args.speculative,
            num_speculative_tokens=args.num_speculative_tokens,
            draft=args.draft,
        )
    except ValueError as e:
        raise TallowError(str(e)) from e
