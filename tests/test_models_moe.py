"""Mixture-of-experts tiny models against transformers (issue 22): more experts than
picked per token, tokens of one batch routed to different experts, dense and MoE layers
in one model; the same weights through a GGUF with stacked expert tensors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf_models import LAYER_NAMES, write_gguf
from test_int8_decode import HAS_VNNI, TARGET
from test_parity import PROMPTS, run_parity, runner_for

from tallow.compiler.pipeline import CompileOptions, compile_model
from tallow.model_defs.moe import EXPERT_PARAMS
from tallow.runtime.manifest import Manifest
from tallow.schedules.cpu import moe_int8

from tiny_models import load_hf

pytestmark = pytest.mark.slow


def routed_experts(hf, ids: list[int]) -> set[tuple[int, ...]]:
    """The expert sets transformers' router picks for each token of layer 0."""
    picks: list = []
    gate = hf.model.layers[0].mlp.gate
    hook = gate.register_forward_hook(lambda _m, _i, out: picks.append(out[2]))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    hook.remove()
    return {tuple(sorted(row.tolist())) for row in picks[0]}


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_logits_match_transformers_f32(name, tiny_model_dir, tiny_artifact):
    """Grouped experts: the prefill batch routes its tokens to different experts; each
    decode step batches two tokens, so with Qwen's 8 or 6 experts (2 per token) some experts
    get no rows in every step, and the grouped matmuls skip them."""
    hf = load_hf(tiny_model_dir(name))
    assert len(routed_experts(hf, PROMPTS[0] + PROMPTS[1])) >= 4  # tokens differ in routing
    if name != "mixtral":
        assert len(PROMPTS) * hf.config.num_experts_per_tok < hf.config.num_experts
    worst, _, picks = run_parity(runner_for(tiny_artifact(name, "f32")), hf)
    assert worst <= 1e-4, f"{name}: max abs logit error {worst}"
    assert [o for o, _, _ in picks] == [r for _, r, _ in picks]


# Per family: the HF module holding the experts and the names of gate, up and down.
EXPERT_NAMES = {
    "qwen3moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "qwen2moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "llama": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
}


def stack_experts(weights: dict, experts: int, arch: str) -> dict:
    """llama.cpp's layout: per layer, the experts of each projection stacked into one
    [experts, rows, cols] tensor (ffn_gate_exps, ffn_up_exps, ffn_down_exps) and the
    router as ffn_gate_inp; the per-expert tensors leave `weights`."""
    module, names = EXPERT_NAMES[arch]
    layers = {n.split(".")[2] for n in weights if f".{module}.experts." in n}
    out = {}
    for layer in sorted(layers):
        p = f"model.layers.{layer}.{module}"
        for kind, name in names.items():
            parts = [weights.pop(f"{p}.experts.{e}.{name}.weight") for e in range(experts)]
            out[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack(parts)
        out[f"blk.{layer}.ffn_gate_inp.weight"] = weights.pop(f"{p}.gate.weight")
        if f"{p}.shared_expert_gate.weight" in weights:  # Qwen2-MoE; its gate as a vector
            for kind in ("gate", "up", "down"):
                shared = weights.pop(f"{p}.shared_expert.{kind}_proj.weight")
                out[f"blk.{layer}.ffn_{kind}_shexp.weight"] = shared
            gate = weights.pop(f"{p}.shared_expert_gate.weight")
            out[f"blk.{layer}.ffn_gate_inp_shexp.weight"] = gate.reshape(-1)
    return out


# Per family, the block type of each stacked expert tensor (and Qwen2-MoE's shared expert):
# the ten GGUF formats between them, K-quants and legacy ones.
QUANTIZED_EXPERTS = {
    "qwen3moe": ("qwen3_moe_wide", {"gate": "q4k", "up": "q5_0", "down": "q6k"}),
    "qwen2moe": ("qwen2_moe_wide", {"gate": "q2k", "up": "q8_0", "down": "q3k", "shexp": "q4_0"}),
    "llama": ("mixtral_wide", {"gate": "q4_1", "up": "q5k", "down": "q5_1"}),
}


def _quantize_stacks(stacked: dict, types: dict) -> tuple[dict, dict]:
    """The GGUF tensors with the expert stacks (and shared expert) in their block types, and
    each tensor as gguf's own dequantizer reads it back (the oracle's weights)."""
    import gguf
    from gguf_models import quantized_tensor

    written, oracle = {}, {}
    for name, arr in stacked.items():
        kind = name.split(".")[2]  # ffn_gate_exps, ffn_down_shexp, ffn_gate_inp, ...
        role = kind.removeprefix("ffn_").split("_")[0]
        qtype = types.get("shexp") if kind.endswith("_shexp") else types.get(role)
        if kind.startswith("ffn_gate_inp") or qtype is None:
            written[name] = oracle[name] = arr
            continue
        blocks, ggml_type = quantized_tensor(np.ascontiguousarray(arr, np.float32), qtype)
        written[name] = (blocks, ggml_type)
        oracle[name] = gguf.quants.dequantize(blocks, ggml_type).reshape(arr.shape)
    return written, oracle


def round_expert_inputs(hf, nudge: float = 0.0) -> None:
    """transformers' experts with each matmul's input rows rounded as the int8 grouped
    kernels round them (schedules/cpu/moe_int8.py, on AVX-512 VNNI): the rule written in
    numpy by the dense int8 kernels' tests, applied in the eager experts' `F.linear` calls
    only (router, attention and a shared expert stay float, as in our kernels). `nudge`:
    before rounding, move every input by that fraction of its 32-group's largest magnitude,
    up and down in turn (see `_rounding_spread`)."""
    import functools

    from test_int8_decode import _round_activations

    float_linear = torch.nn.functional.linear

    def rounded_linear(x, w, b=None):
        groups = x.detach().reshape(-1, x.shape[-1] // 32, 32).numpy().astype(np.float32)
        top = np.abs(groups).max(axis=2, keepdims=True)
        signs = np.where(np.arange(groups.size).reshape(groups.shape) % 2, -1, 1)
        moved = (groups + np.float32(nudge) * top * signs).astype(np.float32)
        values, _ = _round_activations(moved.reshape(-1, x.shape[-1]))
        return float_linear(torch.from_numpy(values.astype(np.float32)).reshape(x.shape), w, b)

    def forward_rounded(forward, *args, **kwargs):
        torch.nn.functional.linear = rounded_linear
        try:
            return forward(*args, **kwargs)
        finally:
            torch.nn.functional.linear = float_linear

    for m in hf.modules():
        if type(m).__name__.endswith("Experts"):
            m.config._experts_implementation = "eager"  # the loop over experts, F.linear
            m.forward = functools.partial(forward_rounded, m.forward)


# Float32 noise before the rounding: our expert inputs differ from transformers' by float32
# summation order and the fast SiLU's rounding (float32-sized), so an activation within that
# of a rounding boundary can get the next int8 code on one side only: a change of one code
# step (1/127 of its group's largest value), not float32-sized. The tolerance for that is
# measured on the oracle itself: its logits with the expert inputs nudged by 1e-5 of their
# group's largest value before rounding (far above float32 noise, so at least as many codes
# flip) against its logits without. Measured (2026-12-02): spread 0.04-0.07 on logits up to
# 13 (2e-6 gave 0.014-0.056: one flip already moves a logit by about that); our error
# 2e-5-4e-4; against the oracle without rounding, 0.17 (qwen3moe).
ROUNDING_NUDGE = 1e-5


def _rounding_spread(oracle_dir) -> float:
    logits = []
    for nudge in (0.0, ROUNDING_NUDGE):
        hf = load_hf(oracle_dir)
        round_expert_inputs(hf, nudge)
        with torch.no_grad():
            logits.append([hf(torch.tensor([p])).logits[0].numpy() for p in PROMPTS])
    return max(float(np.abs(a - b).max()) for a, b in zip(*logits, strict=True))


def _unstack(oracle: dict, experts: int, arch: str) -> dict:
    """`stack_experts` backwards: HF tensor names for the (dequantized) stacks."""
    module, names = EXPERT_NAMES[arch]
    out = {}
    for name, arr in oracle.items():
        _, layer, kind, _ = name.split(".")
        p = f"model.layers.{layer}.{module}"
        role = kind.removeprefix("ffn_").split("_")[0]
        if kind.endswith("_exps"):
            for e in range(experts):
                out[f"{p}.experts.{e}.{names[role]}.weight"] = np.ascontiguousarray(arr[e])
        elif kind == "ffn_gate_inp":
            out[f"{p}.gate.weight"] = arr
        elif kind == "ffn_gate_inp_shexp":
            out[f"{p}.shared_expert_gate.weight"] = arr.reshape(1, -1)
        else:
            out[f"{p}.shared_expert.{role}_proj.weight"] = arr
    return out


@pytest.mark.parametrize("arch", list(QUANTIZED_EXPERTS))
def test_moe_gguf_quantized_experts_match_dequantized_oracle(arch, tiny_model_dir, tmp_path):
    """Stacked expert tensors as llama.cpp writes them (Mixtral: a `llama` GGUF with an
    expert count and q/k rows permuted), kept in their GGUF block types (three formats per
    family, ten in all), give the logits of transformers running the weights as `gguf`
    dequantizes them (the float GGUF case is this one with float blocks: not repeated);
    the artifact stores the stacks as blocks (no float copy of any expert)."""
    from safetensors.numpy import load_file, save_file

    name, types = QUANTIZED_EXPERTS[arch]
    src = tiny_model_dir(name)
    cfg = json.loads((src / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    weights = {k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    stacked = stack_experts(weights, experts, arch)
    written, oracle = _quantize_stacks(stacked, types)
    # the oracle: the same folder with the experts as gguf dequantizes them
    oracle_dir = tmp_path / "oracle"
    oracle_dir.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (oracle_dir / f.name).write_bytes(f.read_bytes())
    save_file({**weights, **_unstack(oracle, experts, arch)}, oracle_dir / "model.safetensors")

    class Writer:  # quantized tensors go in with their raw GGML type
        @staticmethod
        def add(w, tensors):
            for n, t in tensors.items():
                if isinstance(t, tuple):
                    w.add_tensor(n, t[0], raw_dtype=t[1])
                else:
                    w.add_tensor(n, t)

    gguf_path = write_gguf(
        src,
        tmp_path / "moe.gguf",
        arch,
        permute_qk=arch == "llama",
        skip=lambda n: n not in weights,
        metadata_fn=lambda w, c: (
            w.add_expert_count(experts),
            w.add_expert_used_count(c["num_experts_per_tok"]),
            w.add_expert_feed_forward_length(c.get("moe_intermediate_size") or 0),
            w.add_expert_shared_feed_forward_length(c.get("shared_expert_intermediate_size") or 0),
            Writer.add(w, written),
        ),
        layer_names=LAYER_NAMES,
    )
    artifact = compile_model(
        CompileOptions(model=str(gguf_path), output=tmp_path / "a", quiet=True)
    )
    stacks = {p.name: p for p in Manifest.read(artifact).params if ".experts." in p.name}
    assert len(stacks) == 3
    for pname, info in stacks.items():
        role = pname.rsplit(".", 1)[1].removesuffix("_proj")
        assert (info.quant, info.dtype) == (types[role], "uint8"), pname
    hf = load_hf(oracle_dir)
    # on AVX-512 VNNI the quantized experts take int8 activations: the oracle rounds them too
    if HAS_VNNI:
        h, w = cfg["hidden_size"], cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        shapes = {"gate": (w, h), "up": (w, h), "down": (h, w)}
        # every stack takes the int8 kernel, so every expert input is rounded
        assert all(moe_int8.supports(types[r], *shapes[r], TARGET) for r in shapes)
        round_expert_inputs(hf)
    spread = _rounding_spread(oracle_dir) if HAS_VNNI else 0.0
    worst, scale, picks = run_parity(runner_for(artifact), hf)
    bound = 1e-5 * max(scale, 1.0) + spread
    assert worst <= bound, f"{arch}: max abs logit error {worst} of {scale} (spread {spread})"
    assert [o for o, _, _ in picks] == [r for _, r, _ in picks]


def test_moe_quant_mix_on_safetensors_matches_dequantized_oracle(tiny_model_dir, tmp_path):
    """`--quant q4k_m` on a safetensors MoE: the per-expert tensors become one stacked
    parameter per projection in the mix's type (ffn_down_exps is ffn_down: q6k in this
    one-layer model's "more bits" layer), and the logits are transformers' on every weight
    as `gguf` dequantizes its blocks. Built for x86-64-v2: without AVX2 the dense quantized
    projections keep float activations in decode too (the int8-activation kernels round
    them, docs/cpu-kernels.md), so the comparison is exact up to float32 rounding."""
    import gguf
    from safetensors.numpy import load_file, save_file

    from tallow.compiler.quant import QUANT_FORMATS, quantize
    from tallow.model_defs.registry import get_architecture

    src = tiny_model_dir("qwen3_moe_wide")
    artifact = compile_model(
        CompileOptions(
            model=str(src), output=tmp_path / "a", quant="q4k_m", cpu=["x86-64-v2"], quiet=True
        )
    )
    params = {p.name: p for p in Manifest.read(artifact).params}
    p = "model.layers.0.mlp.experts"
    got = [(params[f"{p}.{n}"].quant, params[f"{p}.{n}"].dtype) for n in EXPERT_PARAMS]
    assert got == [("q4k", "uint8"), ("q4k", "uint8"), ("q6k", "uint8")]
    cfg = json.loads((src / "config.json").read_text())
    arch = get_architecture(cfg)
    sources = arch.hf_weight_map(arch.config_from_hf(cfg))
    weights = {k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    # each parameter's source tensors; a fused one split into runs of one type
    # (`P.runs.N.weight`, q/k in q4k beside v in q6k) takes its parts in order, by rows
    pending = {n: list(s) for n, s in sources.items()}
    for name, info in params.items():
        fused = name.split(".runs.")[0] + ".weight" if ".runs." in name else name
        parts, rows = [], 0
        while rows < info.shape[0]:
            parts.append(pending[fused].pop(0))
            rows += weights[parts[-1]].shape[0]
        if info.quant == "none":
            continue
        ggml = QUANT_FORMATS[info.quant].ggml_type
        for s in parts:  # blocks never straddle rows: each source on its own
            w = weights[s]
            weights[s] = gguf.quants.dequantize(quantize(w, info.quant), ggml).reshape(w.shape)
    oracle = tmp_path / "oracle"
    oracle.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (oracle / f.name).write_bytes(f.read_bytes())
    save_file(weights, oracle / "model.safetensors")
    worst, scale, picks = run_parity(runner_for(artifact), load_hf(oracle))
    assert worst <= 1e-5 * max(scale, 1.0), f"max abs logit error {worst} of {scale}"
    assert [o for o, _, _ in picks] == [r for _, r, _ in picks]
