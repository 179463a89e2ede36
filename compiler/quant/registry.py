"""The one table of weight block formats: `QUANT_FORMATS`, name -> `QuantFormat`.

The family packages (`legacy`, `kquants`, `iquants`) register their formats when
`tallow.compiler.quant` is imported; the compiler, the model definitions, the schedules,
the GGUF reader and the CLI all read this table, so a new format is one new module that
calls `register_format`. Order matters only for listing (help texts, tests): a format's
fallback must be registered before it.
"""

from __future__ import annotations

from .format import QuantFormat

QUANT_FORMATS: dict[str, QuantFormat] = {}


def register_format(fmt: QuantFormat) -> QuantFormat:
    """Add `fmt` to the table (returned, so it can decorate an assignment)."""
    if fmt.name in QUANT_FORMATS:
        raise ValueError(f"quantization format {fmt.name!r} is already registered")
    if fmt.block_size <= 0 or fmt.type_size <= 0:
        raise ValueError(f"{fmt.name}: block and type sizes must be positive")
    if fmt.fallback is not None:
        fallback = QUANT_FORMATS.get(fmt.fallback)
        if fallback is None:
            raise ValueError(f"{fmt.name}: fallback {fmt.fallback!r} is not registered")
        if fmt.block_size % fallback.block_size or fallback.block_size == fmt.block_size:
            raise ValueError(
                f"{fmt.name}: fallback {fallback.name}'s block size {fallback.block_size} "
                f"must be a proper divisor of {fmt.block_size}"
            )
    if fmt.ggml_type is not None and format_for_ggml_type(fmt.ggml_type) is not None:
        raise ValueError(f"{fmt.name}: GGML type {fmt.ggml_type!r} already has a format")
    QUANT_FORMATS[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format (tests that register one of their own)."""
    users = [f.name for f in QUANT_FORMATS.values() if f.fallback == name]
    if users:
        raise ValueError(f"cannot unregister {name!r}: {', '.join(users)} fall back to it")
    del QUANT_FORMATS[get_format(name).name]


def get_format(name: str) -> QuantFormat:
    """The format called `name`; a ValueError listing the valid names otherwise."""
    fmt = QUANT_FORMATS.get(name)
    if fmt is None:
        raise ValueError(
            f"unknown quantization type {name!r}; valid names: {', '.join(QUANT_FORMATS)}"
        )
    return fmt


def format_for_ggml_type(ggml_type) -> QuantFormat | None:
    """The format stored as GGUF tensor type `ggml_type`, or None."""
    for fmt in QUANT_FORMATS.values():
        if fmt.ggml_type is not None and fmt.ggml_type == ggml_type:
            return fmt
    return None
