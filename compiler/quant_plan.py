"""Which weight is stored in which format: the `--quant` decision for every parameter.

* No `--quant` and a GGUF source: each weight keeps its own GGUF type (a mixed Q4_K_M file
  stays mixed). Fused parameters (q/k/v, gate/up) keep the type only when all their parts
  share it; otherwise, and for float tensors, the weight is dequantized to `--dtype`.
* `--quant MIX`: a named mix (`quant.mixes`: llama.cpp's q2k, q3k_s/m/l, q4k_s/m, q5k_s/m,
  q6k, q8_0, q4_0, q4_1, q5_0, q5_1; `q4k` is q4k_m) chooses a format per tensor by role
  and layer (`mix_plan`), with llama.cpp's fallbacks for rows the block does not divide
  (q2k/q3k -> q4_0, q4k -> q5_0, q5k -> q5_1, q6k -> q8_0; a row neither divides stays
  float). `--quant FORMAT:all` puts every linear weight and the embedding in one format.
  A GGUF source already quantized is refused unless `allow_requantize`
  (`requantize_guard`).
* `--quant f32|f16|bf16` (or none with a float source): plain float weights.
Norms and biases always stay float, as in llama.cpp.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tallow.runtime.errors import TargetError

from .mix_plan import mix_part_types
from .quant.mixes import FLOAT, find_mix, mix_names
from .requantize_guard import check_requantization

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
    """The valid `--quant` names: the float formats, the mixes and their aliases, then
    `FORMAT:all` for every registered block format (llama.cpp's ftype spellings, such as
    Q4_K_M, are accepted too)."""
    return (*FLOAT_FORMATS, *mix_names())


def check_quant_option(quant: str | None, dtype: str) -> None:
    if quant is not None and quant not in FLOAT_FORMATS and find_mix(quant) is None:
        raise TargetError(f"unknown --quant {quant!r}; valid: {', '.join(quant_choices())}")
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
    *,
    tied_output: bool | None = None,
    allow_requantize: bool = False,
) -> QuantPlan:
    """`shape_of(src)` is a source tensor's shape, `source_type(src)` its GGUF type name
    (a QUANT_FORMATS key) or "float"; `tied_output`: the config's tie_word_embeddings."""
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
    mix = find_mix(quant)
    part_types = mix_part_types(mix, weight_map, shape_of, tied_output)
    check_requantization(mix.name, weight_map, part_types, source_type, allow_requantize)
    plan.label = mix.name
    for p, types in part_types.items():
        # TODO(mixedfused): parts of different types get their own storage there; until
        # then such a fused weight stays float, as a mixed GGUF's does.
        if len(set(types)) == 1 and types[0] != FLOAT:
            plan.types[p] = types[0]
            if all(source_type(s) == types[0] for s in weight_map[p]):
                plan.reused.add(p)
    return plan
