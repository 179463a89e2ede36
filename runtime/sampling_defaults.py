"""The sampling a model is meant to run with, for the fields a request leaves unset.

Models ship their authors' choice in `generation_config.json` (temperature, top_p, top_k,
min_p, repetition_penalty); llama.cpp's converter copies it into a GGUF's
`general.sampling.*` keys. The compiler records it in the manifest (`sampling_defaults`),
and the server and `tallow generate` apply it to every field a request does not set, as
vLLM does with its default `--generation-config auto`. A field the model does not name keeps
OpenAI's neutral value (temperature 1, top_p 1, no top_k, min_p or penalty).

A source that names none of the five (most GGUF files, many folders) gets `FALLBACK`,
llama.cpp's own defaults (`common/common.h`: temperature 0.8, top_k 40, top_p 0.95, min_p
0.05): what users of GGUF files already get from llama.cpp's tools, and a cut (min_p, top_k)
that keeps a temperature-1 tail of junk tokens out. Measured on the embedded SmolLM2-135M
(30 seeds, "What is the capital of Germany?" as a chat): "Berlin" 21 times with these, 12
with OpenAI's temperature 1 (several answers ran to the 512-token limit); a model this small
needs its card's temperature 0.2 for 30 of 30, which the embedded model records
(`compiler/default_model.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import TallowError

# The fields a model may default, with the neutral value a request gets when neither the
# request nor the model sets one (OpenAI's for temperature and top_p; off for the others).
NEUTRAL_VALUES: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
FIELDS = tuple(NEUTRAL_VALUES)

# llama.cpp's converter writes generation_config.json's fields under these GGUF keys.
GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}

# Where the values came from, as the manifest and `tallow serve` say it.
FROM_GENERATION_CONFIG = "generation_config.json"
FROM_GGUF = "gguf general.sampling"
FROM_FALLBACK = "tallow (the source sets none: llama.cpp's defaults)"
FROM_OPENAI = "OpenAI's neutral values"


class SamplingDefaultsError(TallowError):
    """A default sampling value that is not a number in its field's range."""


@dataclass(frozen=True)
class SamplingDefaults:
    """Default values of the sampling fields; None: the field's neutral value."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = FROM_OPENAI

    def value(self, name: str) -> float | int:
        """The field's default: the model's, else the neutral value."""
        v = getattr(self, name)
        return NEUTRAL_VALUES[name] if v is None else v

    def given(self) -> dict[str, float | int]:
        """The fields this set names (the others are neutral)."""
        return {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}

    def overridden(self, source: str, **values: float | int | None) -> SamplingDefaults:
        """These defaults with the non-None `values` put over them (`tallow serve` flags)."""
        given = {k: v for k, v in values.items() if v is not None}
        if not given:
            return self
        checked = check_values(given, source)
        return dataclasses.replace(self, **checked, source=f"{self.source}; {source}")

    def describe(self) -> str:
        values = ", ".join(f"{k} {v:g}" for k, v in self.given().items())
        return f"{values or 'temperature 1, top_p 1'} (from {self.source})"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SamplingDefaults:
        """A manifest's record (checked: a hand-edited manifest gets a clear error)."""
        source = str(raw.get("source", "manifest"))
        values = {f: raw[f] for f in FIELDS if raw.get(f) is not None}
        return cls(**check_values(values, f"manifest sampling_defaults ({source})"), source=source)


NEUTRAL = SamplingDefaults()
FALLBACK = SamplingDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, source=FROM_FALLBACK)


def from_generation_config(config: Mapping[str, Any]) -> SamplingDefaults | None:
    """The fields `generation_config.json` sets; None when it sets none of them."""
    values = {f: config[f] for f in FIELDS if config.get(f) is not None}
    if not values:
        return None
    return SamplingDefaults(
        **check_values(values, FROM_GENERATION_CONFIG), source=FROM_GENERATION_CONFIG
    )


def from_gguf(field: Callable[[str], Any]) -> SamplingDefaults | None:
    """The `general.sampling.*` keys of a GGUF (`field(key)` returns a key's value or None);
    None when the file has none of them."""
    values = {f: field(key) for f, key in GGUF_KEYS.items() if field(key) is not None}
    if not values:
        return None
    return SamplingDefaults(**check_values(values, FROM_GGUF), source=FROM_GGUF)


def model_defaults(found: SamplingDefaults | None) -> SamplingDefaults:
    """What a source's defaults become in the manifest: its own, or `FALLBACK`."""
    return found if found is not None else FALLBACK


def check_values(values: Mapping[str, Any], where: str) -> dict[str, float | int]:
    """Each value as its field's type, in the range the sampler accepts (`SamplingParams`;
    wider than a request's 0-2 temperature, as `tallow generate` always took); else a
    `SamplingDefaultsError` naming `where` and the field."""
    out: dict[str, float | int] = {}
    for name, raw in values.items():
        if name not in NEUTRAL_VALUES:
            raise SamplingDefaultsError(f"{where}: unknown sampling field {name!r}")
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise SamplingDefaultsError(f"{where}: {name} must be a number (got {raw!r})")
        value: float | int = int(raw) if name == "top_k" else float(raw)
        if name == "top_k" and value != raw:
            raise SamplingDefaultsError(f"{where}: top_k must be an integer (got {raw!r})")
        if not _in_range(name, value):
            raise SamplingDefaultsError(f"{where}: {name} {raw!r} is out of range ({RANGES[name]})")
        out[name] = value
    return out


RANGES = {
    "temperature": "0 to 100",
    "top_p": "above 0, at most 1",
    "top_k": "-1 or more",
    "min_p": "0 to 1",
    "repetition_penalty": "above 0",
}


def _in_range(name: str, v: float) -> bool:
    if not math.isfinite(v):
        return False
    return {
        "temperature": 0.0 <= v <= 100.0,
        "top_p": 0.0 < v <= 1.0,
        "top_k": v >= -1,
        "min_p": 0.0 <= v <= 1.0,
        "repetition_penalty": v > 0.0,
    }[name]
