"""The requantization guard: `--quant` on a GGUF whose weights are already quantized.

Decoding a block-quantized weight and encoding it again in another block type stacks two
rounding errors: the source's (fixed in the file) and the new format's. At or below the
source's bits per weight the result is worse than quantizing the original float weights
once; above it, the file grows and gains nothing back. llama.cpp's `quantize` therefore
refuses any quantized input without `--allow-requantize`, and so does tallow, per tensor:

* a source tensor kept in its own type is copied block for block: not requantization
  (`--quant q4_1` on a Q4_1 file, or no `--quant` at all);
* a source tensor decoded to float (a float `--quant`, a row no block divides) loses
  nothing: allowed;
* any other quantized source tensor is requantized: refused unless allowed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from tallow.runtime.errors import ModelSourceError

from .quant import get_format
from .quant.mixes import FLOAT


def requantized(
    weight_map: Mapping[str, Sequence[str]],
    part_types: Mapping[str, Sequence[str]],
    source_type: Callable[[str], str],
) -> list[tuple[str, str, str]]:
    """(source tensor, its block type, planned block type) for every quantized source
    tensor the plan re-encodes in a different block type."""
    out = []
    for param, types in part_types.items():
        for src, new in zip(weight_map[param], types, strict=True):
            old = source_type(src)
            if old != "float" and new != FLOAT and new != old:
                out.append((src, old, new))
    return out


def _bpw(fmt: str) -> str:
    return f"{get_format(fmt).bits_per_weight:.3g} bpw"


def _tally(names: Sequence[str], spell: Callable[[str], str]) -> str:
    return ", ".join(f"{n} x {spell(t)} ({_bpw(t)})" for t, n in Counter(names).most_common())


def check_requantization(
    label: str,
    weight_map: Mapping[str, Sequence[str]],
    part_types: Mapping[str, Sequence[str]],
    source_type: Callable[[str], str],
    allow: bool,
) -> None:
    """Raise ModelSourceError naming the loss when the plan requantizes, unless `allow`."""
    found = requantized(weight_map, part_types, source_type)
    if not found or allow:
        return
    ggml = lambda t: get_format(t).ggml_type.name  # noqa: E731 - the file's own spelling
    worse = sum(get_format(new).bits_per_weight <= get_format(old).bits_per_weight
                for _, old, new in found)  # fmt: skip
    why = (
        f"{worse} of them would get no more bits than they have"
        if worse
        else "more bits cannot bring back what the source's rounding lost"
    )
    raise ModelSourceError(
        f"--quant {label} would requantize {len(found)} tensor(s) that the GGUF source "
        f"already stores quantized: source tensors are {_tally([o for _, o, _ in found], ggml)}; "
        f"requantized to {_tally([n for _, _, n in found], str)}. Quantizing rounded weights "
        f"again loses precision twice (the source's rounding error plus the new format's); "
        f"{why}. Pass --allow-requantize to accept the loss, or leave out --quant to keep the "
        f"file's own types (or quantize from the float original)."
    )
