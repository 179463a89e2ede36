"""Which weight is stored in which format: the `--quant` decision for every parameter.

* No `--quant` and a GGUF source: each weight keeps its own GGUF type (a mixed Q4_K_M file
  stays mixed), fused parameters (q/k/v, gate/up) included: when their parts' types differ
  (Q4_K_M's `attn_v` Q8_0 beside `attn_q`/`attn_k` Q5_0), each run of parts of one type
  becomes its own parameter and matmul (`model_defs.projections`). Float tensors are
  dequantized to `--dtype`.
* `--quant MIX`: a named mix (`quant.mixes`: llama.cpp's q2k, q3k_s/m/l, q4k_s/m, q5k_s/m,
  q6k, q8_0, q4_0, q4_1, q5_0, q5_1; `q4k` is q4k_m) chooses a format per tensor by role
  and layer (`mix_plan`), with llama.cpp's fallbacks for rows the block does not divide
  (q2k/q3k -> q4_0, q4k -> q5_0, q5k -> q5_1, q6k -> q8_0; a row neither divides stays
  float). `--quant FORMAT:all` puts every linear weight and the embedding in one format.
  A GGUF source already quantized is refused unless `allow_requantize`
  (`requantize_guard`).
* `--quant f32|f16|bf16` (or none with a float source): plain float weights.
Norms and biases always stay float, as in llama.cpp.

Any per-tensor choice (a named mix, the kept GGUF types) goes through one entry point,
`plan_from_part_types`: one type per source tensor of every parameter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tallow.model_defs.weight_map import FLOAT, WeightMap, part_runs, run_param
from tallow.runtime.errors import TargetError

from .mix_plan import mix_part_types
from .quant import get_format
from .quant.mixes import find_mix, mix_names, unwritable_reason
from .requantize_guard import check_requantization

FLOAT_FORMATS = ("f32", "f16", "bf16")
QUANTIZABLE = (
    "qkv_proj.weight",
    "o_proj.weight",
    "gate_up_proj.weight",
    "down_proj.weight",
    "lm_head.weight",
    "embed_tokens.weight",
    "experts.gate_proj",  # a MoE layer's stacked experts (model_defs/moe.py)
    "experts.up_proj",
    "experts.down_proj",
)


@dataclass
class QuantPlan:
    label: str  # the format named in the artifact name and manifest ("q4_1", "f32", ...)
    # module parameter -> block type; float if absent. A split fused weight's runs are here
    # under their own names (`projections.run_param`), not the fused name.
    types: dict[str, str] = field(default_factory=dict)
    reused: set[str] = field(default_factory=set)  # params whose GGUF blocks are copied as-is
    # fused parameter whose parts' types differ -> one type per part (FLOAT: a float part)
    parts: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def qtype(self, name: str) -> str:
        return self.types.get(name, FLOAT)

    def module_types(self) -> dict[str, str | tuple[str, ...]]:
        """What the model definition builds from (`model_defs.decoder.QuantTypes`): the
        block type of each parameter, and the per-part types of each split fused one."""
        return {**self.types, **self.parts}

    def param_weight_map(self, weight_map: WeightMap) -> WeightMap:
        """`weight_map` with each split fused parameter replaced by its runs' parameters,
        each mapped to the source tensors of its parts (the module's parameter names)."""
        out: WeightMap = {}
        for param, sources in weight_map.items():
            if param not in self.parts:
                out[param] = sources
                continue
            for i, (a, b, _) in enumerate(part_runs(self.parts[param])):
                out[run_param(param, i)] = sources[a:b]
        return out


def plan_from_part_types(
    label: str,
    weight_map: WeightMap,
    part_types: Mapping[str, Sequence[str]],
    source_type: Callable[[str], str] = lambda _: "float",
) -> QuantPlan:
    """The plan storing each source tensor in the type chosen for it.

    `part_types[param]` has one entry per source tensor of `weight_map[param]` (its fused
    parts, in order): a `QUANT_FORMATS` name, or FLOAT ("none") for a float weight; a
    parameter absent from `part_types` stays float. Parts that share one type make one
    parameter, as before; a fused parameter whose parts differ is split into runs of one
    type each (`model_defs.projections.part_runs`). A weight or run whose every source
    tensor already has its type (`source_type(tensor)`, "float" for float sources) is
    copied block for block, not requantized.
    """
    plan = QuantPlan(label=label)
    for param, types in part_types.items():
        sources = weight_map.get(param)
        if sources is None:
            raise ValueError(f"part types given for {param!r}, which is not a model parameter")
        if len(types) != len(sources):
            raise ValueError(
                f"{param}: {len(types)} part type(s) for {len(sources)} source tensor(s)"
            )
        for t in types:
            if t != FLOAT:
                get_format(t)  # a ValueError naming the valid types
        runs = part_runs(types)
        if len(runs) > 1:
            plan.parts[param] = tuple(types)
        for i, (a, b, t) in enumerate(runs):
            name = param if len(runs) == 1 else run_param(param, i)
            if t == FLOAT:
                continue
            plan.types[name] = t
            if all(source_type(s) == t for s in sources[a:b]):
                plan.reused.add(name)
    return plan


def quant_choices() -> tuple[str, ...]:
    """The valid `--quant` names: the float formats, the mixes and their aliases, then
    `FORMAT:all` for every registered block format (llama.cpp's ftype spellings, such as
    Q4_K_M, are accepted too)."""
    return (*FLOAT_FORMATS, *mix_names())


def check_quant_name(quant: str | None) -> None:
    """`--quant` names a float format or a mix (checked before anything slow is loaded)."""
    if quant is not None and quant not in FLOAT_FORMATS and find_mix(quant) is None:
        if (reason := unwritable_reason(quant)) is not None:
            raise TargetError(f"--quant {quant}: {reason}")
        raise TargetError(f"unknown --quant {quant!r}; valid: {', '.join(quant_choices())}")


def check_quant_option(quant: str | None, dtype: str) -> None:
    check_quant_name(quant)
    if quant in FLOAT_FORMATS and quant != dtype:
        raise TargetError(
            f"--quant {quant} with --dtype {dtype}: float weights use the compute dtype; "
            f"pass --dtype {quant} instead"
        )


def make_plan(
    quant: str | None,
    dtype: str,
    weight_map: WeightMap,
    shape_of,
    source_type,
    *,
    tied_output: bool | None = None,
    allow_requantize: bool = False,
    num_experts: int = 0,
    file_type: str | None = None,
) -> QuantPlan:
    """`shape_of(src)` is a source tensor's shape, `source_type(src)` its GGUF type name
    (a QUANT_FORMATS key) or "float"; `tied_output`: the config's tie_word_embeddings;
    `num_experts`: the config's experts per MoE layer (0: a dense model); `file_type`: the
    quantization the source declares (`ModelSource.file_type`), the label of kept types."""
    check_quant_option(quant, dtype)
    targets = [p for p in weight_map if p.endswith(QUANTIZABLE)]
    if quant is None:
        part_types = {
            p: [FLOAT if (t := source_type(s)) == "float" else t for s in weight_map[p]]
            for p in targets
        }
        kept = Counter(t for types in part_types.values() for t in types if t != FLOAT)
        label = (file_type or kept.most_common(1)[0][0]) if kept else dtype
        return plan_from_part_types(label, weight_map, part_types, source_type)
    if quant in FLOAT_FORMATS:
        return QuantPlan(label=dtype)
    mix = find_mix(quant)
    part_types = mix_part_types(mix, weight_map, shape_of, tied_output, num_experts)
    check_requantization(mix.name, weight_map, part_types, source_type, allow_requantize)
    return plan_from_part_types(mix.name, weight_map, part_types, source_type)
