"""Mixture-of-experts tiny models against transformers (issue 22): more experts than
picked per token, tokens of one batch routed to different experts, dense and MoE layers
in one model; the same weights through a GGUF with stacked expert tensors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf_models import LAYER_NAMES, write_gguf
from test_parity import PROMPTS, run_parity, runner_for

from tallow.compiler.pipeline import CompileOptions, compile_model

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
    hf = load_hf(tiny_model_dir(name))
    assert len(routed_experts(hf, PROMPTS[0] + PROMPTS[1])) >= 4  # tokens differ in routing
    worst, _, picks = run_parity(runner_for(tiny_artifact(name, "f32")), hf)
    assert worst <= 1e-4, f"{name}: max abs logit error {worst}"
    assert [o for o, _, _ in picks] == [r for _, r, _ in picks]


def stack_experts(folder, weights: dict) -> dict:
    """llama.cpp's layout: per layer, the experts of each projection stacked into one
    [experts, rows, cols] tensor (ffn_gate_exps, ffn_up_exps, ffn_down_exps) and the
    router as ffn_gate_inp."""
    cfg = json.loads((folder / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    out = {}
    for name in list(weights):
        if ".mlp.experts.0." not in name:
            continue
        layer = name.split(".")[2]
        kind = name.split(".")[-2].removesuffix("_proj")
        parts = [weights.pop(name.replace("experts.0.", f"experts.{e}.")) for e in range(experts)]
        out[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack(parts)
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        out[f"blk.{name.split('.')[2]}.ffn_gate_inp.weight"] = weights.pop(name)
    return out


def test_qwen3moe_gguf_matches_transformers(tiny_model_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tiny_model_dir("qwen3_moe")
    cfg = json.loads((folder / "config.json").read_text())
    # llama.cpp's qwen3moe makes every layer a MoE layer: a copy of the tiny model without
    # its dense layer, checked against transformers on that copy
    src = tmp_path / "all-moe"
    src.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (src / f.name).write_bytes(f.read_bytes())
    del cfg["mlp_only_layers"]
    cfg["num_hidden_layers"] = 1
    (src / "config.json").write_text(json.dumps(cfg))
    weights = {
        k: v
        for f in folder.glob("*.safetensors")
        for k, v in load_file(f).items()
        if not k.startswith(("model.layers.1.", "model.layers.2."))
    }
    save_file(weights, src / "model.safetensors")
    stacked = stack_experts(src, dict(weights))
    gguf_path = write_gguf(
        src,
        tmp_path / "moe.gguf",
        "qwen3moe",
        extra_tensors=stacked,
        skip=lambda n: ".mlp.experts." in n or n.endswith("mlp.gate.weight"),
        metadata_fn=lambda w, c: (
            w.add_expert_count(c.get("num_experts") or c["num_local_experts"]),
            w.add_expert_used_count(c["num_experts_per_tok"]),
            w.add_expert_feed_forward_length(c["moe_intermediate_size"]),
        ),
        layer_names=LAYER_NAMES,
    )
    artifact = compile_model(
        CompileOptions(model=str(gguf_path), output=tmp_path / "a", quiet=True)
    )
    worst, _, picks = run_parity(runner_for(artifact), load_hf(src))
    assert worst <= 1e-4, f"qwen3moe GGUF: max abs logit error {worst}"
