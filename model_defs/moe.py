"""Mixture-of-experts feed-forward: a softmax router picks `num_experts_per_tok` of
`num_experts` gated-MLP experts per token and sums their outputs weighted by the router.

Only the picked experts run, grouped by expert (kernels in `schedules/moe.py`): the
router's top k per token (the family's normalisation), a counting sort of the step's
(token, slot) pairs by expert, one grouped matmul per projection in which each expert with
at least one row reads its weights once for all its rows (experts nobody picked cost
nothing), the activation, and a weighted sum of each token's k rows. Decode and prefill
(any token count) take the same path.

Expert weights are stored stacked, one parameter per projection: `experts.gate_proj` and
`experts.up_proj` [experts * width, hidden], `experts.down_proj` [experts * hidden, width]
(a GGUF `ffn_*_exps` tensor is that stack already). Each is float or one GGUF block type
(uint8 [rows, row_bytes]), dequantized inside the grouped matmul, never stored as float.
On CPUs with AVX-512 VNNI a float32 model's quantized stacks take int8 activations instead
(`schedules/cpu/moe_int8.py`, the dense layers' tiles), as the dense int8 passes do.

Tensor parallelism (tensor_parallel.py): every worker holds every expert at 1/N of its width
(and the shared expert at 1/N of its own), the router whole; the layer's one all-reduce
follows the weighted sum plus the shared expert's share.
"""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from tallow.compiler.quant.registry import get_format
from tallow.runtime.errors import ModelSourceError

from .config import DecoderConfig
from .parts import activation
from .quant_ops import row_bytes

# the stacked expert parameters, in the order of their GGUF tensors
EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")


def _is_gpu(target: Target | None) -> bool:
    return target is not None and target.kind.name != "llvm"


class MoEMLP(nn.Module):
    """Routed experts, plus (Qwen2-MoE) a shared expert every token passes through, scaled
    by sigmoid(shared_expert_gate . x)."""

    def __init__(
        self,
        config: DecoderConfig,
        dtype: str,
        prefix: str,
        quant: dict[str, str],
        target: Target | None = None,
    ):
        from .decoder import MLP, linear  # the dense parts (decoder.py imports this module)

        self.shared_expert = self.shared_expert_gate = None
        # tensor parallelism: each worker's experts (and shared expert) are 1/N of their width;
        # one all-reduce sums the partial outputs of both (tensor_parallel.py)
        self.tensor_parallel = config.tensor_parallel
        if config.shared_expert_intermediate_size:
            width = config.shared_expert_intermediate_size
            self.shared_expert = MLP(
                config, dtype, f"{prefix}.shared_expert", quant, width, reduce=False
            )
            gate = linear(f"{prefix}.shared_expert_gate", config.hidden_size, 1, False, dtype, {})
            self.shared_expert_gate = gate
        self.act = config.hidden_act
        self.top_k = config.num_experts_per_tok
        self.normalise = config.norm_topk_prob
        self.dtype = dtype
        self.gpu = _is_gpu(target)
        self.target = target
        e, h, w = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.hidden, self.width = e, h, w
        self.gate = nn.Linear(h, e, bias=False, dtype=dtype)  # the router
        types = {p: quant.get(f"{prefix}.experts.{p}", "none") for p in EXPERT_PARAMS}
        self.experts = MoEExperts(e, h, w, dtype, types)

    def forward(self, x: Tensor) -> Tensor:
        from tallow.schedules.cpu import moe_int8
        from tallow.schedules.moe import (
            combine_kernel,
            group_kernel,
            grouped_matmul_kernel,
            route_kernel,
        )

        from .decoder import all_reduce

        b, s, h = x.shape
        e, k, w = self.num_experts, self.top_k, self.width
        tokens = op.reshape(x, (b * s, h))
        n = b * s * k
        weights, ids = op.tensor_ir_op(
            route_kernel(e, k, self.normalise, self.dtype, self.gpu),
            "moe_route",
            args=[self.gate(tokens)],
            out=(
                Tensor.placeholder([b * s, k], "float32"),
                Tensor.placeholder([b * s, k], "int32"),
            ),
        )
        indptr, rows, slot, active = op.tensor_ir_op(
            group_kernel(e, k, self.gpu),
            "moe_group",
            args=[ids],
            out=(
                Tensor.placeholder([e + 1], "int32"),
                Tensor.placeholder([n], "int32"),
                Tensor.placeholder([n], "int32"),
                Tensor.placeholder([e + 1], "int32"),
            ),
        )

        def grouped(inp: Tensor, name: str, n_out: int, k_dim: int, gather: bool) -> Tensor:
            qtype = self.experts.types[name]
            if self.dtype == "float32" and moe_int8.supports(qtype, n_out, k_dim, self.target):
                # AVX-512 VNNI: int8 activations, as the dense layers' int8 passes give them
                kernel = moe_int8.grouped_int8_kernel(e, n_out, k_dim, qtype, gather)
            else:
                kernel = grouped_matmul_kernel(
                    e, n_out, k_dim, qtype, self.dtype, self.dtype, gather, self.gpu
                )
            return op.tensor_ir_op(
                kernel,
                # kernels of one shape and format are one function (gate and up share it)
                f"moe_grouped_{'in' if gather else 'out'}"
                + (f"_{qtype}" if qtype != "none" else ""),
                args=[inp, rows, indptr, active, getattr(self.experts, name)],
                out=Tensor.placeholder([n, n_out], self.dtype),
            )

        gate = grouped(tokens, "gate_proj", w, h, True)
        up = grouped(tokens, "up_proj", w, h, True)
        down = grouped(activation(gate, self.act) * up, "down_proj", h, w, False)
        out = op.tensor_ir_op(
            combine_kernel(h, k, self.dtype, self.gpu),
            "moe_combine",
            args=[down, slot, weights],
            out=Tensor.placeholder([b * s, h], self.dtype),
        )
        if self.shared_expert is not None:
            shared = self.shared_expert(tokens)
            out = out + op.sigmoid(self.shared_expert_gate(tokens)) * shared
        return op.reshape(all_reduce(out, self.tensor_parallel), (b, s, h))


class MoEExperts(nn.Module):
    """The stacked experts: float [experts * rows, cols], or uint8 GGUF blocks
    [experts * rows, row_bytes] for a parameter whose `types` entry names a block format."""

    def __init__(self, experts: int, hidden: int, width: int, dtype: str, types: dict[str, str]):
        self.types = types
        shapes = {"gate_proj": (width, hidden), "up_proj": (width, hidden)}
        shapes["down_proj"] = (hidden, width)
        for name, (rows, cols) in shapes.items():
            qtype = types[name]
            if qtype == "none":
                param = nn.Parameter((experts * rows, cols), dtype=dtype)
            elif get_format(qtype).table is not None:
                raise ModelSourceError(
                    f"the experts' {name} are {get_format(qtype).ggml_type.name}: the MoE "
                    "grouped kernels do not take the lattice i-quants (IQ1-IQ3) yet"
                )
            else:
                param = nn.Parameter((experts * rows, row_bytes(qtype, cols)), dtype="uint8")
            setattr(self, name, param)


def with_moe_layers(dense_map, experts_of, shared_of=None):
    """A dense weight map whose MoE layers' MLP names become the router and the stacked
    experts: `experts_of(config, i)` names the layer's router and the sources of its gate,
    up and down stacks (one GGUF tensor each, or one tensor per expert);
    `shared_of(config, i)`, where given, the shared expert's (gate, up, down, sigmoid gate)
    sources."""

    def weight_map(config: DecoderConfig) -> dict[str, list[str]]:
        m = dense_map(config)
        for i in config.moe_layers:
            p = f"model.layers.{i}.mlp"
            del m[f"{p}.gate_up_proj.weight"], m[f"{p}.down_proj.weight"]
            router, *stacks = experts_of(config, i)
            m[f"{p}.gate.weight"] = [router]
            for name, sources in zip(EXPERT_PARAMS, stacks, strict=True):
                m[f"{p}.experts.{name}"] = sources
            if shared_of is not None and config.shared_expert_intermediate_size:
                gate, up, down, sigmoid_gate = shared_of(config, i)
                m[f"{p}.shared_expert.gate_up_proj.weight"] = [gate, up]
                m[f"{p}.shared_expert.down_proj.weight"] = [down]
                m[f"{p}.shared_expert_gate.weight"] = [sigmoid_gate]
        return m

    return weight_map


def gguf_experts(config, i: int):
    """llama.cpp's names for layer `i`'s router and stacked experts, the same in every MoE
    architecture it writes (qwen3moe, qwen2moe, llama with experts)."""
    b = f"blk.{i}"
    stacks = ([f"{b}.ffn_{x}_exps.weight"] for x in ("gate", "up", "down"))
    return (f"{b}.ffn_gate_inp.weight", *stacks)
