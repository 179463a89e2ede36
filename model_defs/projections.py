"""Fused projections (q/k/v, gate/up) whose parts are stored in different formats.

A fused projection is one matmul over the concatenated rows of its parts. llama.cpp's mixes
often give the parts different block types (Q4_K_M: `attn_q`/`attn_k` Q5_0 or Q4_K, `attn_v`
Q6_K or Q8_0). Rather than dequantize such a weight to float, the parts are grouped into
*runs* of consecutive parts of one type, and each run is its own linear layer (its own
fused dequantize-matmul kernel, so the int8-activation decode kernels apply to every run);
their outputs are concatenated, so the rest of the graph sees the fused output it always did.

Runs and their parameter names (`P.runs.{i}.weight` for the fused `P.weight`) come from
`weight_map.part_runs` / `run_param`, shared with the compiler's weight plan
(`compiler.quant_plan`). A projection whose parts share one type stays one parameter
`P.weight`, as before.

Cost of the split (`benchmarks/split_projection.py`, Qwen2.5-0.5B's q/k/v 896 -> 896+128+128,
a shared 2-core Zen 4, so rough): the same q8_0 weights as three runs plus the concatenation
took 96-103 µs per decode call against 85 µs as one kernel (batch 16: 292-322 against
280-307); the float32 copy this replaces took about 2,100 µs. A single kernel over row ranges
of different formats would save at most those 11-18 µs per layer, so each run is its own
kernel (table in `docs/cpu-kernels.md`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from .quant_ops import QuantLinear
from .weight_map import FLOAT, part_runs


def _linear(in_f: int, out_f: int, qtype: str, dtype: str) -> nn.Module:
    if qtype == FLOAT:
        return nn.Linear(in_f, out_f, bias=False, dtype=dtype)
    return QuantLinear(in_f, out_f, qtype, out_dtype=dtype)


class SplitProjection(nn.Module):
    """`x @ concat(W_0, …, W_n)^T (+ bias)` with each run W_i in its own format.

    Its parameters are `runs.{i}.weight` (see `run_param`) and the fused float `bias`.
    """

    def __init__(
        self,
        in_f: int,
        part_rows: Sequence[int],
        part_types: Sequence[str],
        dtype: str,
        bias: bool,
    ):
        if len(part_rows) != len(part_types):
            raise ValueError(f"{len(part_rows)} parts but {len(part_types)} part types")
        self.runs = nn.ModuleList(
            [_linear(in_f, sum(part_rows[a:b]), t, dtype) for a, b, t in part_runs(part_types)]
        )
        self.bias = nn.Parameter((sum(part_rows),), dtype=dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = op.concat([run(x) for run in self.runs], dim=-1)
        return y + self.bias if self.bias is not None else y


def fused_linear(
    name: str,
    in_f: int,
    part_rows: Sequence[int],
    bias: bool,
    dtype: str,
    quant: dict,
    single,
) -> nn.Module:
    """The module for fused projection `name` (parts of `part_rows` rows each).

    `quant[f"{name}.weight"]` is one type name (or absent: float) when the parts share a
    format; then `single(name, in_f, out_f, bias, dtype, quant)` builds the usual one-matmul
    layer. A tuple of one type per part ("none": float) builds a `SplitProjection`.
    """
    types = quant.get(f"{name}.weight", FLOAT)
    if isinstance(types, str):
        return single(name, in_f, sum(part_rows), bias, dtype, quant)
    return SplitProjection(in_f, part_rows, tuple(types), dtype, bias)
