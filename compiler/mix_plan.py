"""A named mix (`--quant q4k_m`) applied to tallow's parameters: one type per source tensor.

The mixes (`quant.mixes`) speak llama.cpp's GGUF tensor names; tallow's module fuses q/k/v
and gate/up into one parameter each. This module names every part of every quantizable
parameter the GGUF way (whatever the source's own names: a safetensors folder too), asks the
mix, and returns the types per part, in the parameter's part order, for the plan
(`quant_plan`), which decides how parts of different types are stored.
"""

from __future__ import annotations

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


def gguf_part_names(param: str) -> tuple[str, ...] | None:
    """The GGUF names of a parameter's parts, or None for a parameter no mix quantizes."""
    for suffix, name in _GLOBAL_PARAMS.items():
        if param.endswith(suffix):
            return (name,)
    for pattern, roles in _LAYER_PARAMS:
        if m := pattern.search(param):
            return tuple(f"blk.{m[1]}.{role}.weight" for role in roles)
    return None


def mix_part_types(
    mix: Mix,
    weight_map: Mapping[str, Sequence[str]],
    shape_of: Callable[[str], Sequence[int]],
    tied_output: bool | None = None,
) -> dict[str, list[str]]:
    """{parameter: [type of each part]} for every parameter the mix quantizes; a type is a
    `QUANT_FORMATS` name or `mixes.FLOAT`. `tied_output` (the config's
    tie_word_embeddings) matters when the head is not in `weight_map` (an embedding-only
    artifact); by default a missing lm_head means a tied one."""
    parts: dict[str, tuple[str, ...]] = {}
    shapes: dict[str, Sequence[int]] = {}
    for param, sources in weight_map.items():
        names = gguf_part_names(param)
        if names is None:
            continue
        if len(names) != len(sources):
            raise ValueError(f"{param}: {len(sources)} source tensors, expected {len(names)}")
        parts[param] = names
        shapes.update((n, tuple(shape_of(s))) for n, s in zip(names, sources, strict=True))
    facts = ModelFacts.from_tensors(shapes)
    if tied_output is not None and tied_output != facts.tied_output:
        facts = ModelFacts(facts.n_layer, facts.n_head, facts.n_head_kv, tied_output)
    types = mix.types(shapes, facts)
    return {param: [types[n] for n in names] for param, names in parts.items()}
