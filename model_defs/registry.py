"""The one place that maps an HF `architectures` name to its model definition."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tvm.relax.frontend import nn

from .config import DecoderConfig
from .config_fields import COMMON_FIELDS
from .weight_map import WeightMap


@dataclass(frozen=True)
class Architecture:
    """What the compiler needs to know about one model family."""

    hf_name: str
    config_from_hf: Callable[[dict[str, Any]], DecoderConfig]
    build: Callable[..., nn.Module]  # (config, dtype, target, quant=None)
    hf_weight_map: Callable[[DecoderConfig], WeightMap]
    # GGUF: llama.cpp's architecture name, its metadata -> config.json table, tensor names,
    # and whether llama.cpp's converter permuted the q/k rows (it does for "llama" only).
    gguf_arch: str | None = None
    gguf_config_keys: dict[str, str] | None = None
    gguf_weight_map: Callable[[DecoderConfig], WeightMap] | None = None
    gguf_permute_qk: bool = False
    # What llama.cpp fixes per architecture instead of writing it to the metadata: completes
    # the config dict read through `gguf_config_keys` (in place).
    gguf_config_fixup: Callable[[dict[str, Any]], None] | None = None
    # The config.json fields this family's reader reads (config_fields.py has the rest).
    config_fields: frozenset[str] = COMMON_FIELDS


class UnknownArchitectureError(ValueError):
    pass


def _registry() -> dict[str, Architecture]:
    from . import gemma, llama, mixtral, phi3, qwen2, qwen3, qwen_moe

    archs = [
        *llama.ARCHITECTURES,
        *qwen2.ARCHITECTURES,
        *qwen3.ARCHITECTURES,
        *gemma.ARCHITECTURES,
        *phi3.ARCHITECTURES,
        *qwen_moe.ARCHITECTURES,
        *mixtral.ARCHITECTURES,
    ]
    return {a.hf_name: a for a in archs}


def supported_architectures() -> list[str]:
    return sorted(_registry())


def get_gguf_architecture(gguf_arch: str) -> Architecture:
    by_gguf = {a.gguf_arch: a for a in _registry().values() if a.gguf_arch}
    if gguf_arch not in by_gguf:
        raise UnknownArchitectureError(
            f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(sorted(by_gguf))}"
        )
    return by_gguf[gguf_arch]


def get_architecture(hf_config: dict[str, Any]) -> Architecture:
    names = hf_config.get("architectures") or []
    registry = _registry()
    for name in names:
        if name in registry:
            return registry[name]
    shown = ", ".join(names) if names else "none given"
    raise UnknownArchitectureError(
        f"unsupported architecture ({shown}); supported: {', '.join(sorted(registry))}"
    )
