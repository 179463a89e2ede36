"""Fused projections whose parts have different block types (issue 20, item 3).

llama.cpp's mixes store q, k and v (and gate, up) in different types; tallow keeps each
part's type, one matmul per run of parts of one type, rather than a float copy.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from tallow.compiler.quant import QUANT_FORMATS
from tallow.compiler.quant_plan import make_plan, plan_from_part_types
from tallow.model_defs.weight_map import part_runs, run_param

QKV = "layers.0.self_attn.qkv_proj.weight"
GATE_UP = "layers.0.mlp.gate_up_proj.weight"
WEIGHT_MAP = {
    QKV: ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"],
    "layers.0.self_attn.qkv_proj.bias": ["blk.0.attn_q.bias", "blk.0.attn_k.bias", "b.v"],
    GATE_UP: ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"],
    "layers.0.mlp.down_proj.weight": ["blk.0.ffn_down.weight"],
}


def test_part_runs_group_consecutive_types():
    assert part_runs(["q5_0", "q5_0", "q8_0"]) == [(0, 2, "q5_0"), (2, 3, "q8_0")]
    assert part_runs(["q4k", "q5_0", "q4k"]) == [(0, 1, "q4k"), (1, 2, "q5_0"), (2, 3, "q4k")]
    assert part_runs(["q8_0", "q8_0"]) == [(0, 2, "q8_0")]
    assert run_param(QKV, 1) == "layers.0.self_attn.qkv_proj.runs.1.weight"
    with pytest.raises(ValueError, match="ends in '.weight'"):
        run_param("layers.0.self_attn.qkv_proj.bias", 0)


def test_mixed_parts_split_into_runs():
    """Q4_K_M's layout: q/k Q5_0, v Q8_0 (kept from the GGUF), gate Q4_K beside a float up."""
    source = {"blk.0.attn_q.weight": "q5_0", "blk.0.attn_k.weight": "q5_0"}
    source |= {"blk.0.attn_v.weight": "q8_0", "blk.0.ffn_gate.weight": "q4k"}
    plan = plan_from_part_types(
        "q5_0",
        WEIGHT_MAP,
        {QKV: ["q5_0", "q5_0", "q8_0"], GATE_UP: ["q4k", "none"]},
        lambda s: source.get(s, "float"),
    )
    qkv0, qkv1 = run_param(QKV, 0), run_param(QKV, 1)
    gate, up = run_param(GATE_UP, 0), run_param(GATE_UP, 1)
    assert plan.types == {qkv0: "q5_0", qkv1: "q8_0", gate: "q4k"}  # the float run: absent
    assert plan.reused == {qkv0, qkv1, gate}  # the GGUF blocks, copied
    assert plan.parts == {QKV: ("q5_0", "q5_0", "q8_0"), GATE_UP: ("q4k", "none")}
    assert plan.qtype(up) == "none" and plan.qtype(QKV) == "none"
    assert plan.module_types()[QKV] == ("q5_0", "q5_0", "q8_0")
    split = plan.param_weight_map(WEIGHT_MAP)
    assert split[qkv0] == ["blk.0.attn_q.weight", "blk.0.attn_k.weight"]
    assert split[qkv1] == ["blk.0.attn_v.weight"]
    assert split[gate] == ["blk.0.ffn_gate.weight"] and split[up] == ["blk.0.ffn_up.weight"]
    assert QKV not in split and GATE_UP not in split
    # the bias stays one fused float parameter
    assert (
        split["layers.0.self_attn.qkv_proj.bias"] == WEIGHT_MAP["layers.0.self_attn.qkv_proj.bias"]
    )


def test_parts_of_one_type_stay_one_parameter():
    plan = plan_from_part_types("q4_0", WEIGHT_MAP, {QKV: ["q4_0"] * 3})
    assert plan.types == {QKV: "q4_0"} and plan.parts == {} and plan.reused == set()
    assert plan.param_weight_map(WEIGHT_MAP) == WEIGHT_MAP


def test_requantized_run_is_not_reused():
    """A run whose source has another type is requantized, not copied."""
    source = {"blk.0.attn_q.weight": "q4k", "blk.0.attn_k.weight": "q5_0"}
    plan = plan_from_part_types(
        "m", WEIGHT_MAP, {QKV: ["q5_0", "q5_0", "q8_0"]}, lambda s: source.get(s, "float")
    )
    assert plan.reused == set()


def test_bad_part_types_are_named():
    with pytest.raises(ValueError, match="2 part type\\(s\\) for 3 source tensor"):
        plan_from_part_types("x", WEIGHT_MAP, {QKV: ["q4_0", "q8_0"]})
    with pytest.raises(ValueError, match="unknown quantization type 'q9'"):
        plan_from_part_types("x", WEIGHT_MAP, {QKV: ["q4_0", "q9", "q8_0"]})
    with pytest.raises(ValueError, match="not a model parameter"):
        plan_from_part_types("x", WEIGHT_MAP, {"nope.weight": ["q4_0"]})


def test_kept_gguf_types_keep_mixed_parts():
    """No --quant on a mixed GGUF: every part keeps its type; the label is the commonest."""
    source = {"blk.0.attn_q.weight": "q5_0", "blk.0.attn_k.weight": "q5_0"}
    source |= {"blk.0.attn_v.weight": "q8_0", "blk.0.ffn_gate.weight": "q5_0"}
    source |= {"blk.0.ffn_up.weight": "q5_0", "blk.0.ffn_down.weight": "q6k"}
    plan = make_plan(None, "f32", WEIGHT_MAP, None, lambda s: source.get(s, "float"))
    assert plan.label == "q5_0"
    assert plan.parts == {QKV: ("q5_0", "q5_0", "q8_0")}
    assert plan.types[GATE_UP] == "q5_0" and plan.types["layers.0.mlp.down_proj.weight"] == "q6k"
    assert set(plan.types) == plan.reused


# --- a whole model -------------------------------------------------------------------------

# GGUF tensor -> block type: the parts of every fused projection differ (Q4_K_M's q/k Q5_0
# with v Q8_0; three runs; gate Q4_K with up Q5_0; a quantized gate beside a float up).
# The other matrices stay float: they are not what this test is about, and every further
# (type, shape) is one more kernel to compile.
MIXED_TYPES = {
    "blk.0.attn_q.weight": "q5_0",
    "blk.0.attn_k.weight": "q5_0",
    "blk.0.attn_v.weight": "q8_0",
    "blk.0.ffn_gate.weight": "q4k",
    "blk.0.ffn_up.weight": "q5_0",
    "blk.1.attn_q.weight": "q5_0",
    "blk.1.attn_k.weight": "q8_0",
    "blk.1.attn_v.weight": "q5_0",
    "blk.1.ffn_gate.weight": "q5_0",
}
PROMPTS = [[5, 17, 40, 3, 99, 250, 7], [11, 12, 13, 200, 201, 66, 8, 9, 10, 120, 44]]


@pytest.mark.slow
def test_mixed_gguf_parts_stay_quantized(tiny_model_dir, tmp_path):
    """A GGUF whose q/k/v and gate/up parts have different block types compiles with each part
    in its own type: the artifact holds the GGUF's blocks byte for byte (no float copy), the
    manifest lists each run's type, and the logits equal those of the f32 artifact of the
    same file (dequantized at compile time by gguf's own dequantizers, the oracle).

    On x86 with AVX2 the quantized matmuls of prefill and decode round the activations to
    int8 as llama.cpp does (`compiler.int8_prefill_pass`, `int8_decode_pass`), and each step
    is checked against the f32 model's logits within the activation rounding (12% of the
    largest logit for prefill, 5% for the decode step; a run read in the wrong format is off
    by its whole size). Elsewhere (float activations in both) prefill equals to float32
    rounding."""
    import gguf
    from gguf_models import write_gguf

    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner
    from tallow.runtime.safetensors_io import SafetensorsFile

    path = write_gguf(
        tiny_model_dir("qwen2_wide"), tmp_path / "mixed.gguf", "qwen2", tensor_types=MIXED_TYPES
    )
    art = compile_model(CompileOptions(model=str(path), output=tmp_path / "a", quiet=True))
    f32 = compile_model(
        CompileOptions(model=str(path), quant="f32", output=tmp_path / "f", quiet=True)
    )
    manifest = yaml.safe_load((art / "manifest.yaml").read_text())
    params = {p["name"]: p for p in manifest["params"]}
    qkv, gate_up = "model.layers.{}.self_attn.qkv_proj", "model.layers.{}.mlp.gate_up_proj"
    expected = {
        f"{qkv.format(0)}.runs.0.weight": ("q5_0", ["attn_q", "attn_k"]),
        f"{qkv.format(0)}.runs.1.weight": ("q8_0", ["attn_v"]),
        f"{gate_up.format(0)}.runs.0.weight": ("q4k", ["ffn_gate"]),
        f"{gate_up.format(0)}.runs.1.weight": ("q5_0", ["ffn_up"]),
        f"{qkv.format(1)}.runs.0.weight": ("q5_0", ["attn_q"]),
        f"{qkv.format(1)}.runs.1.weight": ("q8_0", ["attn_k"]),
        f"{qkv.format(1)}.runs.2.weight": ("q5_0", ["attn_v"]),
        f"{gate_up.format(1)}.runs.0.weight": ("q5_0", ["ffn_gate"]),
    }
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    for name, (qtype, parts) in expected.items():
        layer = name.split(".")[2]
        info = params[name]
        assert info["quant"] == qtype and info["dtype"] == "uint8", name
        stored = SafetensorsFile(art / info["shard"]).get(name)
        assert stored.dtype == np.uint8
        blocks = [np.asarray(tensors[f"blk.{layer}.{p}.weight"].data).view(np.uint8) for p in parts]
        assert stored.tobytes() == b"".join(b.tobytes() for b in blocks), name
        cols = 256  # hidden: every one of these is a [rows, hidden] weight
        fmt = QUANT_FORMATS[qtype]
        assert stored.shape[1] == cols // fmt.block_size * fmt.type_size
    # the float part of layer 1's gate/up is its own float run; the fused names are gone
    up = params[f"{gate_up.format(1)}.runs.1.weight"]
    assert (up["quant"], up["shape"]) == ("none", [512, 256])
    assert not any(n.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for n in params)
    assert params[f"{qkv.format(0)}.bias"]["quant"] == "none"  # qwen2's fused float bias

    runners = [TVMModelRunner(a, kv=KVCacheConfig(4, 512, 64)) for a in (art, f32)]
    got, want = [], []
    for runner, out in zip(runners, (got, want), strict=True):
        for i in range(len(PROMPTS)):
            runner.add_sequence(i)
        out.append(runner.forward([(i, p[:-1]) for i, p in enumerate(PROMPTS)]))  # prefill
        out.append(runner.forward([(i, p[-1:]) for i, p in enumerate(PROMPTS)]))  # decode
    (library,) = manifest["libraries"]
    int8_prefill = library["details"].get("prefill_activations") == "int8_g32_row_step"
    scale = np.abs(want[0]).max()
    # int8 rounding on this tiny random model is large: prefill's last rows 6.0% and 7.6% of
    # the largest logit off the f32 model's, the same prompts fed token by token through the
    # int8 decode kernels 6.1% and 6.7% (a run read in the wrong format: about 100%)
    assert np.abs(got[0] - want[0]).max() <= (0.12 if int8_prefill else 1e-4) * scale
    assert np.abs(got[1] - want[1]).max() <= 0.05 * np.abs(want[1]).max()
    if int8_prefill:
        assert not np.array_equal(got[0], want[0])  # the runs' int8 prefill kernels ran
    if library["details"].get("decode_activations") == "int8_g32_row_step":
        assert not np.array_equal(got[1], want[1])  # the runs' int8 kernels really ran
