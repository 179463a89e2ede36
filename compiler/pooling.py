"""Which pooling turns a model's hidden states into one embedding, read from its source.

In order: `--pooling` when given; sentence-transformers' `1_Pooling/config.json` in the source
folder (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`); a decoder published as an
embedding model (its name says "embedding", as Qwen3-Embedding's and gte-Qwen2's do), which
pools the last token; otherwise the mean over the tokens. Embeddings are L2-normalised.
"""

from __future__ import annotations

import json
from pathlib import Path

from tallow.runtime.errors import ModelSourceError
from tallow.runtime.manifest import POOLINGS

POOLING_CONFIG = "1_Pooling/config.json"

# sentence-transformers' flags -> ours; the others (cls, max, weighted mean) are not served.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_ST_UNSUPPORTED = (
    "pooling_mode_cls_token",
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


def choose_pooling(folder: Path | None, name: str, override: str | None) -> tuple[str, str]:
    """(pooling, where it came from)."""
    if override is not None:
        if override not in POOLINGS:
            raise ModelSourceError(f"--pooling {override!r}: choose from {', '.join(POOLINGS)}")
        return override, "--pooling"
    path = folder / POOLING_CONFIG if folder is not None else None
    if path is not None and path.is_file():
        try:
            flags = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ModelSourceError(f"{path}: not valid JSON ({e})") from e
        chosen = [ours for key, ours in _ST_MODES.items() if flags.get(key)]
        if len(chosen) == 1:
            return chosen[0], POOLING_CONFIG
        others = [k for k in _ST_UNSUPPORTED if flags.get(k)]
        raise ModelSourceError(
            f"{path}: pooling {', '.join(others) or 'not one mode'} is not supported "
            f"(tallow pools {' or '.join(POOLINGS)}); pass --pooling to choose one"
        )
    if "embedding" in name.lower():
        return "last", "model name"
    return "mean", "default"
