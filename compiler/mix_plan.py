"""A named mix (`--quant q4k_m`) applied to tallow's parameters: one type per source tensor.

The mixes (`quant.mixes`) speak llama.cpp's GGUF tensor names; tallow's module fuses q/k/v
and gate/up into one parameter each. This module names every part of every quantizable
parameter the GGUF way (whatever the source's own names: a safetensors folder too), asks the
mix, and returns the types per part, in the parameter's part order, for the plan
(`quant_plan`), which decides how parts of different types are stored.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence

from .quant.mixes import Mix, ModelFacts

# tallow parameter (suffix) -> the GGUF roles of its parts, in concatenation order
_LAYER_PARAMS = (
    (re.compile(r"layers\.(\d+)\.(?:.*\.)?qkv_proj\.weight$"), ("attn_q", "attn_k", "attn_v")),
    (re.compile(r"layers\.(\d+)\.(?:.*\.)?o_proj\.weight$"), ("attn_output",)),
    (re.compile(r"layers\.(\d+)\.(?:.*\.)?gate_up_proj\.weight$"), ("ffn_gate", "ffn_up")),
    (re.compile(r"layers\.(\d+)\.(?:.*\.)?down_proj\.weight$"), ("ffn_down",)),
)
_GLOBAL_PARAMS = {"embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
# a MoE layer's stacked experts (`model_defs.moe`): one GGUF tensor [experts, rows, cols]
_EXPERT_PARAM = re.compile(r"layers\.(\d+)\.(?:.*\.)?experts\.(gate|up|down)_proj$")


def gguf_part_names(param: str) -> tuple[str, ...] | None:
    """The GGUF names of a parameter's parts, or None for a parameter no mix quantizes (a
    stacked expert parameter: its one GGUF tensor, see `expert_stack_name`)."""
    if (stack := expert_stack_name(param)) is not None:
        return (stack,)
    for suffix, name in _GLOBAL_PARAMS.items():
        if param.endswith(suffix):
            return (name,)
    for pattern, roles in _LAYER_PARAMS:
        if m := pattern.search(param):
            return tuple(f"blk.{m[1]}.{role}.weight" for role in roles)
    return None


def expert_stack_name(param: str) -> str | None:
    """`blk.{i}.ffn_{gate,up,down}_exps.weight` for a stacked expert parameter, else None."""
    m = _EXPERT_PARAM.search(param)
    return f"blk.{m[1]}.ffn_{m[2]}_exps.weight" if m else None


def mix_part_types(
    mix: Mix,
    weight_map: Mapping[str, Sequence[str]],
    shape_of: Callable[[str], Sequence[int]],
    tied_output: bool | None = None,
    num_experts: int = 0,
) -> dict[str, list[str]]:
    """{parameter: [type of each part]} for every parameter the mix quantizes; a type is a
    `QUANT_FORMATS` name or `mixes.FLOAT`. `tied_output` (the config's
    tie_word_embeddings) matters when the head is not in `weight_map` (an embedding-only
    artifact); by default a missing lm_head means a tied one. A stacked expert parameter
    (one source per expert, or one GGUF stack) is one tensor [num_experts, rows, cols] to the
    mix, and all its parts take its type."""
    parts: dict[str, tuple[str, ...]] = {}
    shapes: dict[str, Sequence[int]] = {}
    for param, sources in weight_map.items():
        names = gguf_part_names(param)
        if names is None:
            continue
        if (stack := expert_stack_name(param)) is not None:
            part_shapes = [tuple(shape_of(s)) for s in sources]
            rows = sum(s[0] for s in part_shapes)
            experts = num_experts or len(sources)
            shapes[stack] = (experts, rows // experts, part_shapes[0][-1])
            parts[param] = (stack,) * len(sources)
            continue
        if len(names) != len(sources):
            raise ValueError(f"{param}: {len(sources)} source tensors, expected {len(names)}")
        parts[param] = names
        shapes.update((n, tuple(shape_of(s))) for n, s in zip(names, sources, strict=True))
    facts = ModelFacts.from_tensors(shapes)
    if tied_output is not None and tied_output != facts.tied_output:
        facts = dataclasses.replace(facts, tied_output=tied_output)
    types = mix.types(shapes, facts)
    return {param: [types[n] for n in names] for param, names in parts.items()}
