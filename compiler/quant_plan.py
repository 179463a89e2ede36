"""Which weight is stored in which format: the `--quant` decision for every parameter.

* No `--quant` and a GGUF source: each weight keeps its own GGUF type (a mixed Q4_K_M file
  stays mixed). Fused parameters (q/k/v, gate/up) keep the type only when all their parts
  share it; otherwise, and for float tensors, the weight is dequantized to `--dtype`.
* `--quant q4_0 … q6k` (any registered format, `tallow.compiler.quant.QUANT_FORMATS`): every
  linear weight and the embedding take that format. A weight whose row length is not a
  multiple of the block size (32, or 256 for K-quants) takes the format's `fallback` as
  llama.cpp does (q2k/q3k → q4_0, q4k → q5_0, q5k → q5_1, q6k → q8_0); a row length that
  fits neither (for a legacy type: not a multiple of 32) stays float.
* `--quant f32|f16|bf16` (or none with a float source): plain float weights.
Norms and biases always stay float, as in llama.cpp.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tallow.runtime.errors import TargetError

from .quant import QUANT_FORMATS, get_format

FLOAT_FORMATS = ("f32", "f16", "bf16")
QUANTIZABLE = (
    "qkv_proj.weight",
    "o_proj.weight",
    "gate_up_proj.weight",
    "down_proj.weight",
    "lm_head.weight",
    "embed_tokens.weight",
)


@dataclass
class QuantPlan:
    label: str  # the format named in the artifact name and manifest ("q4_1", "f32", ...)
    types: dict[str, str] = field(default_factory=dict)  # param -> block type; float if absent
    reused: set[str] = field(default_factory=set)  # params whose GGUF blocks are copied as-is

    def qtype(self, name: str) -> str:
        return self.types.get(name, "none")


def quant_choices() -> tuple[str, ...]:
    """The valid `--quant` names: the float formats, then every registered block format."""
    return (*FLOAT_FORMATS, *QUANT_FORMATS)


def check_quant_option(quant: str | None, dtype: str) -> None:
    choices = quant_choices()
    if quant is not None and quant not in choices:
        raise TargetError(f"unknown --quant {quant!r}; valid: {', '.join(choices)}")
    if quant in FLOAT_FORMATS and quant != dtype:
        raise TargetError(
            f"--quant {quant} with --dtype {dtype}: float weights use the compute dtype; "
            f"pass --dtype {quant} instead"
        )


def make_plan(
    quant: str | None,
    dtype: str,
    weight_map: dict[str, list[str]],
    shape_of,
    source_type,
) -> QuantPlan:
    """`shape_of(src)` is a source tensor's shape, `source_type(src)` its GGUF type name
    (a QUANT_FORMATS key) or "float"."""
    check_quant_option(quant, dtype)
    plan = QuantPlan(label=dtype)
    targets = [p for p in weight_map if p.endswith(QUANTIZABLE)]
    if quant is None:
        kept: Counter[str] = Counter()
        for p in targets:
            kinds = {source_type(s) for s in weight_map[p]}
            if len(kinds) == 1 and (kind := kinds.pop()) != "float":
                plan.types[p] = kind
                plan.reused.add(p)
                kept[kind] += 1
        if kept:
            plan.label = kept.most_common(1)[0][0]
        return plan
    if quant in FLOAT_FORMATS:
        return plan
    plan.label = quant
    for p in targets:
        cols = shape_of(weight_map[p][0])[-1]
        fmt = get_format(quant)
        if fmt.fits(cols):
            plan.types[p] = quant
        elif fmt.fallback is not None and get_format(fmt.fallback).fits(cols):
            plan.types[p] = fmt.fallback
        if p in plan.types and all(source_type(s) == plan.types[p] for s in weight_map[p]):
            plan.reused.add(p)
    return plan
