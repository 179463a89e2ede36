"""Mixture-of-experts feed-forward: a softmax router picks `num_experts_per_tok` of
`num_experts` gated-MLP experts per token and sums their outputs weighted by the router.

This first version computes every expert on every token of the step and zeroes the
weights of the experts a token did not pick. Each expert's weights are read once per
step (grouped by expert, never once per token), and the result is exact, but the
arithmetic is num_experts / num_experts_per_tok times what routing needs (4x for the
tiny test model, 16x for Qwen3-30B-A3B): correct, and slow for large MoE models. A
gather of the picked experts per step is the next step.

Expert weights are stored stacked: all gate projections, then all up projections, as
one [2 * experts * width, hidden] matrix, and all down projections as one
[experts * hidden, width] matrix (a GGUF `ffn_*_exps` tensor is that stack already). They
stay float (a quantized GGUF's experts are dequantized to `--dtype` when compiling).
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from .config import DecoderConfig
from .parts import activation


def route(probs: Tensor, top_k: int, normalise: bool) -> Tensor:
    """Router probabilities [tokens, experts] (float32) -> the weight of each expert per
    token: its probability where it ranks in the top `top_k` of the token, else 0;
    renormalised to sum 1 over the picked experts when `normalise`."""

    def compute(p: te.Tensor):
        tokens, experts = p.shape
        j = te.reduce_axis((0, experts), name="j")
        rank = te.compute(
            (tokens, experts),
            lambda t, e: te.sum(tirx.if_then_else(p[t, j] > p[t, e], 1, 0), axis=j),
            name="rank",
        )
        picked = te.compute(
            (tokens, experts),
            lambda t, e: tirx.if_then_else(rank[t, e] < top_k, p[t, e], tirx.const(0, "float32")),
            name="picked",
        )
        if not normalise:
            return picked
        k = te.reduce_axis((0, experts), name="k")
        total = te.compute((tokens,), lambda t: te.sum(picked[t, k], axis=k), name="total")
        return te.compute((tokens, experts), lambda t, e: picked[t, e] / total[t], name="route")

    return op.tensor_expr_op(compute, name_hint="moe_route", args=[probs])


class MoEMLP(nn.Module):
    """Routed experts, plus (Qwen2-MoE) a shared expert every token passes through, scaled
    by sigmoid(shared_expert_gate . x)."""

    def __init__(self, config: DecoderConfig, dtype: str, prefix: str, quant: dict[str, str]):
        from .decoder import MLP, linear  # the dense parts (decoder.py imports this module)

        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            width = config.shared_expert_intermediate_size
            self.shared_expert = MLP(config, dtype, f"{prefix}.shared_expert", quant, width)
            gate = linear(f"{prefix}.shared_expert_gate", config.hidden_size, 1, False, dtype, {})
            self.shared_expert_gate = gate
        self.act = config.hidden_act
        self.top_k = config.num_experts_per_tok
        self.normalise = config.norm_topk_prob
        e, h, w = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.hidden, self.width = e, h, w
        self.gate = nn.Linear(h, e, bias=False, dtype=dtype)  # the router
        self.experts = MoEExperts(e, h, w, dtype)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        e, w = self.num_experts, self.width
        tokens = op.reshape(x, (b * s, h))
        logits = self.gate(tokens)
        probs = op.softmax(logits.astype("float32") if logits.dtype != "float32" else logits)
        weights = route(probs, self.top_k, self.normalise)  # [tokens, experts]
        gate_w, up_w = op.split(self.experts.gate_up_proj, 2, axis=0)
        batch = op.reshape(tokens, (1, b * s, h))

        def per_expert(stack: Tensor, rows: int, cols: int) -> Tensor:
            return op.permute_dims(op.reshape(stack, (e, rows, cols)), [0, 2, 1])

        gate = op.matmul(batch, per_expert(gate_w, w, h))  # [experts, tokens, width]
        up = op.matmul(batch, per_expert(up_w, w, h))
        down = op.matmul(activation(gate, self.act) * up, per_expert(self.experts.down_proj, h, w))
        scale = op.reshape(op.permute_dims(weights, [1, 0]), (e, b * s, 1))
        scale = scale.astype(x.dtype) if x.dtype != "float32" else scale
        out = op.sum(down * scale, axis=0)  # [tokens, hidden]
        if self.shared_expert is not None:
            shared = self.shared_expert(tokens)
            out = out + op.sigmoid(self.shared_expert_gate(tokens)) * shared
        return op.reshape(out, (b, s, h))


class MoEExperts(nn.Module):
    def __init__(self, experts: int, hidden: int, width: int, dtype: str):
        self.gate_up_proj = nn.Parameter((2 * experts * width, hidden), dtype=dtype)
        self.down_proj = nn.Parameter((experts * hidden, width), dtype=dtype)


def with_moe_layers(dense_map, experts_of, shared_of=None):
    """A dense weight map whose MoE layers' MLP names become the router and the stacked
    experts: `experts_of(config, i)` names the layer's router, its (gate..., up...) and its
    (down...) sources; `shared_of(config, i)`, where given, the shared expert's
    (gate, up, down, sigmoid gate) sources."""

    def weight_map(config: DecoderConfig) -> dict[str, list[str]]:
        m = dense_map(config)
        for i in config.moe_layers:
            p = f"model.layers.{i}.mlp"
            del m[f"{p}.gate_up_proj.weight"], m[f"{p}.down_proj.weight"]
            router, gate_up, down = experts_of(config, i)
            m[f"{p}.gate.weight"] = [router]
            m[f"{p}.experts.gate_up_proj"] = gate_up
            m[f"{p}.experts.down_proj"] = down
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
    gate_up = [f"{b}.ffn_gate_exps.weight", f"{b}.ffn_up_exps.weight"]
    return f"{b}.ffn_gate_inp.weight", gate_up, [f"{b}.ffn_down_exps.weight"]
