"""How a dense decoder is split N ways for tensor parallelism (Megatron-style).

Each worker holds 1/N of the attention heads (q and kv alike) and 1/N of the MLP width:
q/k/v and gate/up are column-parallel (each worker computes its own heads / its own
intermediate columns, no communication), o_proj and down_proj are row-parallel (each worker
multiplies its share of the inputs; the partial outputs are summed by an all-reduce,
`decoder.all_reduce`). Norms, the embedding and the vocab head are replicated: every worker
computes the full logits, so there is no gather, and worker 0's are read.

Mixture-of-experts layers are split by each expert's width, not by expert: every worker
holds every expert's 1/N of the intermediate columns (the router is replicated, so every
worker routes every token the same way), runs the same grouped kernels on its narrower
experts, and one all-reduce follows the experts' down projection (a shared expert's partial
output is added first: its sigmoid gate is computed from the replicated input, so the sum
commutes with it). Splitting by expert would need an all-to-all and balance the workers only
as well as the router balances experts; MLC-LLM chose the width for the same reasons.

The compiler builds the module from `local_config` (one worker's shapes), writes the
weights unsharded, and records a `ShardRule` per split parameter in the manifest; the runtime
cuts each worker's share at load (`runtime/tp_runner.py`) without knowing the model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from .config import DecoderConfig
from .config_fields import ConfigError


@dataclass(frozen=True)
class ShardRule:
    """Cut `axis` of a parameter: each of `parts` (consecutive runs along the axis, e.g. the
    q, k and v rows of a fused qkv) is split in N equal slices, worker i takes slice i of
    every part, concatenated. A row-parallel weight is one part (its whole input axis)."""

    axis: int
    parts: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"axis": self.axis, "parts": list(self.parts)}


def _qkv(c: DecoderConfig) -> list[int]:
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return [q, kv, kv]


def _experts(c: DecoderConfig) -> list[int]:
    # a stacked gate/up: each expert's rows are one part, so each worker gets a slice of each
    return [c.moe_intermediate_size] * c.num_experts


# (parameter-name pattern, axis, parts from the full config; None: the whole axis)
_RULES: tuple[tuple[str, int, Callable[[DecoderConfig], list[int]] | None], ...] = (
    (r"\.self_attn\.qkv_proj\.(weight|bias)$", 0, _qkv),
    (r"\.self_attn\.o_proj\.weight$", 1, None),
    (r"\.mlp\.gate_up_proj\.weight$", 0, lambda c: [c.intermediate_size] * 2),
    (r"\.mlp\.down_proj\.weight$", 1, None),
    (r"\.mlp\.experts\.(gate_proj|up_proj)$", 0, _experts),
    (r"\.mlp\.experts\.down_proj$", 1, None),
    (
        r"\.mlp\.shared_expert\.gate_up_proj\.weight$",
        0,
        lambda c: [c.shared_expert_intermediate_size] * 2,
    ),
    (r"\.mlp\.shared_expert\.down_proj\.weight$", 1, None),
)
# Row-parallel weights and the full width of their inputs: a quantized one must split on
# block boundaries.
_ROW_PARALLEL: dict[str, Callable[[DecoderConfig], int]] = {
    r"\.self_attn\.o_proj\.weight$": lambda c: _qkv(c)[0],
    r"\.mlp\.down_proj\.weight$": lambda c: c.intermediate_size,
    r"\.mlp\.experts\.down_proj$": lambda c: c.moe_intermediate_size,
    r"\.mlp\.shared_expert\.down_proj\.weight$": lambda c: c.shared_expert_intermediate_size,
}


def _widths(c: DecoderConfig) -> dict[str, int]:
    """The widths the degree must divide: the dense MLP's where a layer keeps one, each MoE
    expert's and the shared expert's."""
    widths = {}
    if len(c.moe_layers) < c.num_hidden_layers or not c.num_experts:
        widths["intermediate_size"] = c.intermediate_size
    if c.num_experts:
        widths["moe_intermediate_size"] = c.moe_intermediate_size
    if c.shared_expert_intermediate_size:
        widths["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size
    return widths


def check_degree(config: DecoderConfig, n: int, quant: dict | None = None) -> None:
    """Refuse, in one line, a degree this model cannot be split by."""
    if n < 1 or n & (n - 1):
        raise ConfigError(f"--tensor-parallel {n}: must be a power of two (1, 2, 4, ...)")
    if n == 1:
        return
    kv = config.num_key_value_heads
    if kv % n:
        raise ConfigError(f"--tensor-parallel {n}: does not divide the {kv} KV heads")
    for field, width in _widths(config).items():
        if width % n:
            raise ConfigError(f"--tensor-parallel {n}: does not divide {field} {width}")
    for name, qtype in (quant or {}).items():
        # a fused projection whose parts differ in format (a tuple) is split run by run
        # (`full_shapes`); it is column-parallel, so no block is ever cut
        if not isinstance(qtype, str):
            continue
        inputs = next((f for p, f in _ROW_PARALLEL.items() if re.search(p, name)), None)
        if qtype == "none" or inputs is None:
            continue
        from tallow.compiler.quant.registry import get_format

        block = get_format(qtype).block_size
        cols = inputs(config)
        if (cols // n) % block:
            raise ConfigError(
                f"--tensor-parallel {n}: {name} ({qtype}) would be cut inside a block "
                f"({cols} inputs / {n} is not a multiple of {block})"
            )


def local_config(config: DecoderConfig, n: int) -> DecoderConfig:
    """One worker's share of the layers: 1/n of the heads and of every MLP width (dense,
    each expert's, the shared expert's); the experts' count and the router are whole."""
    if n == 1:
        return config
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // n,
        num_key_value_heads=config.num_key_value_heads // n,
        intermediate_size=config.intermediate_size // n,
        moe_intermediate_size=config.moe_intermediate_size // n,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // n,
        tensor_parallel=n,
    )


def is_split(name: str) -> bool:
    """Whether N workers each hold a slice of parameter `name` (else every one holds it)."""
    return any(re.search(pattern, name) for pattern, _, _ in _RULES)


def shard_rule(name: str, full_shape: tuple[int, ...], config: DecoderConfig) -> ShardRule | None:
    """The rule that cuts parameter `name` (None: replicated on every worker)."""
    for pattern, axis, parts in _RULES:
        if re.search(pattern, name):
            return ShardRule(axis, tuple(parts(config) if parts else [full_shape[axis]]))
    return None


# A fused projection whose parts differ in block format is one parameter per run of
# consecutive parts of one format (model_defs/projections.py): `P.runs.{i}.weight`.
_RUN = re.compile(r"^(.*)\.runs\.(\d+)\.weight$")


def _run_parts(parts: tuple[int, ...], runs: list[int], index: int) -> tuple[int, ...]:
    """The parts of run `index`, the fused projection's `parts` being cut into consecutive
    groups of `runs` rows each (whole sizes)."""
    groups, rest = [], list(parts)
    for rows in runs:
        group = []
        while rest and sum(group) < rows:
            group.append(rest.pop(0))
        if sum(group) != rows:
            raise ConfigError(f"runs of {runs} rows do not follow the parts {list(parts)}")
        groups.append(tuple(group))
    return groups[index]


def full_shapes(params, config: DecoderConfig, n: int) -> tuple[list, dict[str, ShardRule]]:
    """The unsharded `ParamSpec`s of one worker's `params`, and the rule of each split one."""
    if n == 1:
        return list(params), {}
    runs: dict[str, dict[int, int]] = {}  # fused name -> run index -> local rows
    for p in params:
        m = _RUN.match(p.name)
        if m:
            runs.setdefault(m.group(1), {})[int(m.group(2))] = p.shape[0]
    out, rules = [], {}
    for p in params:
        m = _RUN.match(p.name)
        fused = f"{m.group(1)}.weight" if m else p.name
        rule = next(((pat, a) for pat, a, _ in _RULES if re.search(pat, fused)), None)
        if rule is not None:
            axis = rule[1]
            shape = list(p.shape)
            shape[axis] *= n
            p = dataclasses.replace(p, shape=tuple(shape))
            whole = shard_rule(fused, tuple(shape), config)
            if m:  # one run of a fused, column-parallel projection: its own parts
                sizes = [rows * n for _, rows in sorted(runs[m.group(1)].items())]
                whole = ShardRule(axis, _run_parts(whole.parts, sizes, int(m.group(2))))
            rules[p.name] = whole
        out.append(p)
    return out, rules
