"""Named quantization mixes: llama.cpp's recipes (Q4_K_M, Q3_K_S, ...), tensor by tensor.

A mix names a base block format for ordinary weights and, per tensor role, the rules that
give some tensors more bits. They follow llama.cpp's `llama_tensor_get_type` (llama-quant.cpp)
for dense decoders, and `tests/data/llamacpp_mixes.json` (written by llama.cpp itself, see
`tests/fixtures/regen_llamacpp_mixes.py`) checks every tensor of several small models:

* The output head, and the token embedding when it is tied to the head, take q6k (q8_0 in
  the q8_0 mix, and q8_0 whenever the base format's block does not divide its rows): the
  head is what every token's choice reads, and it is one matrix.
* `attn_v` and `ffn_down` are the projections most sensitive to rounding; the _m, _l and
  q2k mixes give them more bits, in all layers or in "more bits" layers: the first and last
  eighth of the stack and every third layer between them.
* A row length the chosen format's block does not divide takes the format's registered
  fallback (llama.cpp's: q2k/q3k -> q4_0, q4k -> q5_0, q5k -> q5_1, q6k -> q8_0); when that
  does not divide it either the tensor stays float (llama.cpp writes F16 there).

* Mixture of experts: a stacked expert tensor (`ffn_gate_exps`, 3-D [experts, rows, cols])
  and a shared expert's (`ffn_down_shexp`) take the rules of their role (`ffn_gate`,
  `ffn_down`), as llama.cpp matches roles by name; with exactly 8 experts (Mixtral) llama.cpp
  gives `attn_v` and `attn_k` q8_0 and, in the q2k, q3k_s/m and q4k_s/m mixes,
  `attn_output` q5k (no other attn_output rule then).

* The i-quant recipes llama.cpp runs without an importance matrix (checked against its output
  like the others): IQ4_NL and IQ4_XS (`attn_v` q5k where 4 or more query heads share a KV
  head, `ffn_down` q5k in the first eighth of the layers), IQ3_S (`attn_v` q4k with 4 or more
  query heads a KV head) and IQ3_M (IQ3_S blocks; `attn_v` and `attn_output` q4k, `ffn_down`
  q4k in the first eighth). llama.cpp 0.3.36's `llama_model_quantize` refuses IQ3_XXS and
  IQ3_XS without an importance matrix, as it does the IQ2 and IQ1 ftypes.

`FORMAT:all` (e.g. `q4k:all`) puts every weight in one format: no head promotion, no rules.
Left out: llama.cpp's branches for Falcon and the IQ3_XXS/IQ3_XS/TQ/MXFP4 ftypes:
`--quant iq3_xxs` is the uniform mix (every weight, the head too, as `iq3_xxs:all`); so are
tq1_0, tq2_0, mxfp4 and nvfp4 (llama.cpp's quantize does not write NVFP4 files). q1_0 is
llama.cpp's Q1_0 recipe (checked): its head q6k; where a row is not a multiple of 128
llama.cpp writes no file at all, and tallow keeps that tensor float. Formats tallow reads
but does not write (the other lattice i-quants, `QuantFormat.no_quantizer`) are no mix:
`unwritable_reason` says why.

Tensors are named as in GGUF files (`token_embd.weight`, `output.weight`,
`blk.{i}.attn_q.weight`, ...), shapes in numpy order ([rows, cols] or [experts, rows, cols];
GGUF's ne[0] is cols).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

# FLOAT ("none"): no block format fits the row length, the tensor stays float (as in manifests)
from tallow.model_defs.weight_map import FLOAT

from .registry import QUANT_FORMATS, get_format

_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
_GLOBAL_ROLES = {"token_embd.weight": "token_embd", "output.weight": "output"}
ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# stacked experts and a shared expert: the rules of the role their name starts with
_ROLE_SUFFIXES = ("_exps", "_shexp")
# ftypes whose attn_output takes q5k in an 8-expert model (llama.cpp's list, our ftypes)
_MOE8_ATTN_OUTPUT_Q5K = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M")


@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp's recipe reads of the model besides a tensor's name and shape."""

    n_layer: int
    n_head: int
    n_head_kv: int
    tied_output: bool  # no output.weight: the token embedding is the head
    n_expert: int = 1  # experts per MoE layer (the first axis of the stacked expert tensors)

    @property
    def n_gqa(self) -> int:
        return self.n_head // max(1, self.n_head_kv)

    @property
    def is_70b(self) -> bool:
        """llama.cpp's LLM_TYPE_70B for dense llama/qwen2-style models: 80 layers with GQA,
        whose attn_v (8 heads sharing it) costs little to store with more bits."""
        return self.n_layer == 80 and self.n_head_kv < self.n_head

    @classmethod
    def from_tensors(cls, shapes: Mapping[str, Sequence[int]]) -> ModelFacts:
        """The facts as llama.cpp derives them from the tensor list: layers counted from
        the `blk.N` names, the GQA ratio from attn_q / attn_k rows (their heads have the same
        size; n_head / n_head_kv then stand for that ratio), a tied head when there is no
        output.weight."""
        layers = [int(m[1]) for n in shapes if (m := _BLOCK_TENSOR.match(n))]
        q, k = shapes.get("blk.0.attn_q.weight"), shapes.get("blk.0.attn_k.weight")
        ratio = q[0] // k[0] if q and k and k[0] else 1
        stacks = [int(s[0]) for n, s in shapes.items() if len(s) == 3 and "_exps." in n]
        return cls(
            n_layer=max(layers) + 1 if layers else 0,
            n_head=ratio,
            n_head_kv=1,
            tied_output="output.weight" not in shapes,
            n_expert=max(stacks, default=1),
        )


def more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth, and every third layer."""
    eighth = n_layer // 8
    return layer < eighth or layer >= 7 * n_layer // 8 or (layer - eighth) % 3 == 2


# A rule: (layer, facts) -> the format for that tensor, or None to keep the mix's base.
Rule = Callable[[int, ModelFacts], "str | None"]


def _when(test: Callable[[int, ModelFacts], bool], fmt: str) -> Rule:
    return lambda layer, facts: fmt if test(layer, facts) else None


def _always(fmt: str) -> Rule:
    return lambda layer, facts: fmt


_MORE_BITS = lambda layer, facts: more_bits(layer, facts.n_layer)  # noqa: E731


@dataclass(frozen=True)
class Mix:
    """One named mix: `base` for ordinary weights, `rules` by tensor role."""

    name: str  # the `--quant` name, and the label of the artifact and manifest
    ftype: str | None  # llama.cpp's name (LLAMA_FTYPE_MOSTLY_<ftype>); None: tallow's own
    base: str  # a registered block format
    rules: Mapping[str, Rule] = field(default_factory=dict)
    # one format for every tensor (llama.cpp's `pure`): no head promotion, no rules
    pure: bool = False

    def types(
        self, shapes: Mapping[str, Sequence[int]], facts: ModelFacts | None = None
    ) -> dict[str, str]:
        """The format of every quantizable tensor in `shapes` (GGUF names): a registered
        format name or FLOAT. Other tensors (norms, biases, unknown names) are left out."""
        facts = facts or ModelFacts.from_tensors(shapes)
        out = {}
        for name, shape in shapes.items():
            role, layer = tensor_role(name)
            if role is None or len(shape) not in (2, 3):
                continue
            out[name] = _fitting(self._choose(role, layer, int(shape[-1]), facts), int(shape[-1]))
        return out

    def _choose(self, role: str, layer: int, cols: int, facts: ModelFacts) -> str:
        is_head = role == "output" or (role == "token_embd" and facts.tied_output)
        if self.pure:
            return self.base
        if is_head:
            if cols % get_format(self.base).block_size:
                return "q8_0"
            return self.base if self.base == "q8_0" else "q6k"
        if facts.n_expert == 8 and role in ("attn_v", "attn_k"):
            return "q8_0"
        if facts.n_expert == 8 and role == "attn_output":
            return "q5k" if self.ftype in _MOE8_ATTN_OUTPUT_Q5K else self.base
        rule = self.rules.get(role)
        fmt = (rule(layer, facts) if rule else None) or self.base
        if role == "attn_v" and facts.is_70b and fmt in ("q3k", "q4k"):
            fmt = "q5k"
        return fmt


def tensor_role(name: str) -> tuple[str | None, int]:
    """(role, layer) of a GGUF tensor name; (None, -1) for tensors no mix quantizes."""
    if name in _GLOBAL_ROLES:
        return _GLOBAL_ROLES[name], -1
    m = _BLOCK_TENSOR.match(name)
    if not m:
        return None, -1
    role = m[2]
    for suffix in _ROLE_SUFFIXES:
        role = role.removesuffix(suffix)
    return (role, int(m[1])) if role in ROLES else (None, -1)


def _fitting(fmt: str, cols: int) -> str:
    """`fmt`, else its fallback, else FLOAT, for rows of `cols` weights (one step, as
    llama.cpp's `tensor_type_fallback`)."""
    f = get_format(fmt)
    if f.fits(cols):
        return fmt
    if f.fallback is not None and get_format(f.fallback).fits(cols):
        return f.fallback
    return FLOAT


def _mixes() -> dict[str, Mix]:
    first_eighth = lambda layer, facts: layer < facts.n_layer // 8  # noqa: E731
    first_sixteenth = lambda layer, facts: layer < facts.n_layer // 16  # noqa: E731
    # _m mixes: attn_v and ffn_down at q6k in the "more bits" layers
    q6k_v_down = {k: _when(_MORE_BITS, "q6k") for k in ("attn_v", "ffn_down")}
    gqa4 = lambda layer, facts: facts.n_gqa >= 4  # noqa: E731
    # IQ4_NL / IQ4_XS: attn_v q5k with 4 or more query heads a KV head, ffn_down q5k in the
    # first eighth of the layers
    iq4_v_down = {"attn_v": _when(gqa4, "q5k"), "ffn_down": _when(first_eighth, "q5k")}
    mixes = [
        Mix(
            "q2k",
            "Q2_K",
            "q2k",
            {
                "attn_v": lambda layer, facts: "q4k" if facts.n_gqa >= 4 else "q3k",
                "ffn_down": _always("q3k"),
                "attn_output": _always("q3k"),
            },
        ),
        Mix("q3k_s", "Q3_K_S", "q3k"),
        Mix(
            "q3k_m",
            "Q3_K_M",
            "q3k",
            {
                "attn_v": lambda layer, facts: "q5k" if layer < 2 else "q4k",
                "ffn_down": lambda layer, facts: "q5k" if first_sixteenth(layer, facts) else "q4k",
                "attn_output": _always("q4k"),
            },
        ),
        Mix(
            "q3k_l",
            "Q3_K_L",
            "q3k",
            {k: _always("q5k") for k in ("attn_v", "ffn_down", "attn_output")},
        ),
        Mix(
            "q4k_s",
            "Q4_K_S",
            "q4k",
            {
                "attn_v": _when(lambda layer, facts: layer < 4, "q5k"),
                "ffn_down": _when(first_eighth, "q5k"),
            },
        ),
        Mix("q4k_m", "Q4_K_M", "q4k", q6k_v_down),
        Mix("q5k_s", "Q5_K_S", "q5k"),
        Mix("q5k_m", "Q5_K_M", "q5k", q6k_v_down),
        Mix("q6k", "Q6_K", "q6k"),
        *(Mix(f, f.upper(), f) for f in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q1_0")),
        # the i-quant recipes llama.cpp runs without an importance matrix
        *(Mix(f, f.upper(), f, iq4_v_down) for f in ("iq4_nl", "iq4_xs")),
        Mix("iq3_s", "IQ3_S", "iq3_s", {"attn_v": _when(gqa4, "q4k")}),
        Mix(
            "iq3_m",
            "IQ3_M",
            "iq3_s",
            {
                "attn_v": _always("q4k"),
                "attn_output": _always("q4k"),
                "ffn_down": _when(first_eighth, "q4k"),
            },
        ),
    ]
    return {m.name: m for m in mixes}


MIXES: dict[str, Mix] = _mixes()
# The short K-quant names mean llama.cpp's medium mix, as its `quantize` tool reads Q4_K.
ALIASES = {"q3k": "q3k_m", "q4k": "q4k_m", "q5k": "q5k_m"}
ALL_SUFFIX = ":all"


def _normal(name: str) -> str:
    """`Q4_K_M`, `MOSTLY_Q4_K_M`, `q4_k_m` -> `q4k_m`."""
    n = name.strip().lower().removeprefix("mostly_")
    return re.sub(r"^q(\d)_k", r"q\1k", n)


def uniform_mix(fmt: str) -> Mix:
    """Every weight, the head and embedding included, in `fmt` (or its fallback)."""
    get_format(fmt)
    return Mix(fmt, None, fmt, pure=True)


def _writable() -> list[str]:
    """The formats tallow can quantize to (some are read only: `QuantFormat.no_quantizer`)."""
    return [f for f, fmt in QUANT_FORMATS.items() if fmt.quantize_blocks is not None]


def find_mix(name: str) -> Mix | None:
    """The mix a `--quant` name means, or None: a mix name or llama.cpp ftype name (any
    case), an alias (q4k = q4k_m), `FORMAT:all`, or a registered format that no mix is
    named after (uniform, as `FORMAT:all`); a format without a quantizer is none of these
    (`unwritable_reason` says why)."""
    n = _normal(name)
    if n.endswith(ALL_SUFFIX):
        fmt = _normal(n.removesuffix(ALL_SUFFIX))
        return uniform_mix(fmt) if fmt in _writable() else None
    n = ALIASES.get(n, n)
    if n in MIXES:
        return MIXES[n]
    if n in _writable():
        return uniform_mix(n)
    return None


def unwritable_reason(name: str) -> str | None:
    """Why `--quant name` (or `name:all`) cannot be written, when it names a format tallow
    reads but does not quantize to; else None."""
    fmt = QUANT_FORMATS.get(_normal(_normal(name).removesuffix(ALL_SUFFIX)))
    return fmt.no_quantizer if fmt is not None and fmt.quantize_blocks is None else None


def mix_names() -> tuple[str, ...]:
    """Every name `find_mix` accepts in its canonical spelling (ftype spellings aside):
    the mixes, the aliases, formats without a mix of their own, `FORMAT:all`."""
    bare = tuple(f for f in _writable() if f not in MIXES and f not in ALIASES)
    return (*MIXES, *ALIASES, *bare, *(f + ALL_SUFFIX for f in _writable()))
