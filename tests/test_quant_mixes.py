"""Named quantization mixes against llama.cpp itself, and the requantization guard.

The oracle is `tests/data/llamacpp_mixes.json`: the GGML type llama.cpp's own quantizer
(llama-cpp-python's `llama_model_quantize`) chose for every tensor of small llama GGUFs —
1 to 16 layers, with and without GQA, tied and separate heads, rows of 256, 160, 96 and 80
weights — in 18 ftypes (the K-quant and legacy mixes, Q1_0, and the i-quants IQ3_S,
IQ3_M, IQ4_NL and IQ4_XS). `tests/fixtures/regen_llamacpp_mixes.py` regenerates it (not run
here: llama-cpp-python takes 10 minutes to build).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tallow.compiler.mix_plan import mix_part_types
from tallow.compiler.quant import QUANT_FORMATS
from tallow.compiler.quant.mixes import FLOAT, MIXES, ModelFacts, find_mix
from tallow.compiler.quant_plan import make_plan
from tallow.model_defs.config import DecoderConfig
from tallow.model_defs.weight_map import dense_decoder_gguf_map, dense_decoder_hf_map

FIXTURE = json.loads((Path(__file__).parent / "data" / "llamacpp_mixes.json").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}
# every ftype the fixture holds (llama.cpp writes no file for some cases: Q1_0 where a row is
# not a multiple of its 128-weight block)
FTYPES = list(dict.fromkeys(f for c in FIXTURE["cases"] for f in c["types"]))


def ggml_name(fmt: str) -> str:
    """tallow's format name as GGML spells it; a float tensor is F16 in llama.cpp's files."""
    return "F16" if fmt == FLOAT else QUANT_FORMATS[fmt].ggml_type.name


def test_fixture_covers_the_issue():
    assert {"Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ3_M"} <= set(FTYPES)
    layers = {c["facts"]["n_layer"] for c in CASES.values()}
    assert {1, 4, 8, 12, 16} <= layers
    gqa = {c["facts"]["n_head"] // c["facts"]["n_head_kv"] for c in CASES.values()}
    assert {1, 2, 4, 8} <= gqa
    cols = {s[-1] for c in CASES.values() for s in c["shapes"].values() if len(s) == 2}
    assert {256, 160, 96, 80} <= cols


@pytest.mark.parametrize("ftype", FTYPES)
def test_mix_matches_llama_cpp(ftype):
    """Every tensor of every case gets the type llama.cpp gave it (norms: never quantized)."""
    mix = find_mix(ftype)
    assert mix is not None and mix.ftype == ftype
    for case in CASES.values():
        if ftype not in case["types"]:
            continue
        f = case["facts"]
        given = ModelFacts(f["n_layer"], f["n_head"], f["n_head_kv"], f["tied"])
        for facts in (given, None):  # the facts stated, and derived from the tensors
            got = mix.types(case["shapes"], facts)
            for name, want in case["types"][ftype].items():
                if name.endswith("_norm.weight"):
                    assert name not in got and want == "F32"
                    continue
                assert ggml_name(got[name]) == want, f"{case['name']} {name}"


def _config(case) -> DecoderConfig:
    f, shapes = case["facts"], case["shapes"]
    hidden = shapes["blk.0.attn_norm.weight"][0]
    return DecoderConfig(
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=shapes["blk.0.ffn_up.weight"][0],
        num_hidden_layers=f["n_layer"],
        num_attention_heads=f["n_head"],
        num_key_value_heads=f["n_head_kv"],
        head_dim=hidden // f["n_head"],
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        context_window_size=128,
        tie_word_embeddings=f["tied"],
    )


@pytest.mark.parametrize("source", ["gguf", "hf"])
@pytest.mark.parametrize("case", ["l12_gqa2_ffn160", "l4_gqa4_tied", "l8_h96_ffn160"])
def test_plan_parts_match_llama_cpp(case, source):
    """tallow's fused parameters (qkv_proj, gate_up_proj), from a GGUF's names or from
    safetensors names: each part gets llama.cpp's type for that tensor."""
    case = CASES[case]
    config = _config(case)
    gguf_map = dense_decoder_gguf_map(config)
    weight_map = gguf_map if source == "gguf" else dense_decoder_hf_map(config)
    shape_of = dict(zip(  # source tensor -> shape, through the GGUF name of the same part
        (s for p in weight_map for s in weight_map[p]),
        (case["shapes"][g] for p in gguf_map for g in gguf_map[p]),
        strict=True,
    )).__getitem__  # fmt: skip
    want = case["types"]["Q4_K_M"]
    parts = mix_part_types(MIXES["q4k_m"], weight_map, shape_of)
    assert "model.layers.0.input_layernorm.weight" not in parts
    checked = 0
    for param, types in parts.items():
        for gguf_part, t in zip(gguf_map[param], types, strict=True):
            assert ggml_name(t) == want[gguf_part], gguf_part
            checked += 1
    assert checked == sum(1 for n in want if not n.endswith("_norm.weight"))
    # the plan: the mix's name as label, the types of every part
    plan = make_plan("Q4_K_M", "f32", weight_map, shape_of, lambda _: "float")
    assert plan.label == "q4k_m"
    for param, types in parts.items():
        if len(set(types)) > 1:  # stored as runs of one type (mixedfused's split storage)
            assert plan.parts[param] == tuple(types)
        else:
            assert plan.qtype(param) == types[0] and param not in plan.parts


def test_names():
    q4k_m = MIXES["q4k_m"]
    for name in ("q4k_m", "Q4_K_M", "q4_k_m", "MOSTLY_Q4_K_M", "q4k", "Q4_K"):
        assert find_mix(name) is q4k_m, name
    assert find_mix("q3k") is MIXES["q3k_m"] and find_mix("Q5_K") is MIXES["q5k_m"]
    assert find_mix("q6k") is MIXES["q6k"] and find_mix("Q8_0") is MIXES["q8_0"]
    uniform = find_mix("q4k:all")
    assert uniform.name == "q4k" and not uniform.rules and uniform.pure
    assert find_mix("Q4_K:ALL").name == "q4k"
    for bad in ("q9", "q4k_x", "q4k_m:all", "iq2_xxs", ""):
        assert find_mix(bad) is None, bad
    # an i-quant's name is llama.cpp's recipe where it has one without an importance matrix,
    # else every weight in it (as FORMAT:all)
    for name in ("iq4_xs", "IQ4_XS", "iq3_m", "IQ3_S"):
        assert find_mix(name) is MIXES[name.lower()] and not find_mix(name).pure, name
    assert MIXES["iq3_m"].base == "iq3_s"
    for name in ("iq3_xxs", "iq4_nl:all", "IQ3_S:all"):
        mix = find_mix(name)
        assert mix.pure and mix.base == name.lower().removesuffix(":all"), name


def test_uniform_mix_is_one_format_with_fallbacks():
    """q4k:all: today's behaviour — the head and embedding in q4k too, fallbacks by row."""
    shapes = {
        "token_embd.weight": (64, 256),
        "output.weight": (64, 256),
        "blk.0.attn_v.weight": (64, 256),
        "blk.0.ffn_down.weight": (256, 160),
        "blk.0.attn_q.weight": (64, 80),
    }
    got = find_mix("q4k:all").types(shapes)
    assert got == {
        "token_embd.weight": "q4k",
        "output.weight": "q4k",
        "blk.0.attn_v.weight": "q4k",
        "blk.0.ffn_down.weight": "q5_0",
        "blk.0.attn_q.weight": FLOAT,
    }
    # the named mix on the same tensors: head q6k, attn_v and ffn_down (layer 0 of 1) q6k
    assert MIXES["q4k_m"].types(shapes)["output.weight"] == "q6k"
    assert MIXES["q4k_m"].types(shapes)["blk.0.attn_v.weight"] == "q6k"


def test_70b_attn_v_gets_q5k():
    """llama.cpp's 70B rule (80 layers, GQA): attn_v at q3k/q4k is raised to q5k. Not in the
    fixture (an 80-layer file); checked on its own here."""
    shapes = {f"blk.{i}.attn_v.weight": (32, 256) for i in range(80)}
    facts = ModelFacts(n_layer=80, n_head=8, n_head_kv=1, tied_output=True)
    assert set(MIXES["q3k_s"].types(shapes, facts).values()) == {"q5k"}
    q4k_m = MIXES["q4k_m"].types(shapes, facts)
    assert q4k_m["blk.9.attn_v.weight"] == q4k_m["blk.12.attn_v.weight"] == "q6k"
    assert q4k_m["blk.10.attn_v.weight"] == q4k_m["blk.11.attn_v.weight"] == "q5k"
    mha = ModelFacts(n_layer=80, n_head=8, n_head_kv=8, tied_output=True)
    assert set(MIXES["q3k_s"].types(shapes, mha).values()) == {"q3k"}


# --- the requantization guard, from the command line -------------------------------------------

LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def q4_1_gguf(tiny_model_dir, tmp_path_factory):
    """The tiny qwen3 model as a GGUF whose matrices are all Q4_1 (as gguf quantizes)."""
    from gguf_models import write_gguf

    types = {f"blk.{i}.{r}.weight": "q4_1" for i in range(2) for r in LINEAR}
    types.update({"token_embd.weight": "q4_1", "output.weight": "q4_1"})
    out = tmp_path_factory.mktemp("q4_1") / "tiny.Q4_1.gguf"
    return write_gguf(tiny_model_dir("qwen3"), out, "qwen3", tensor_types=types)


def compile_argv(model, out, *extra) -> list[str]:
    return ["compile", "--model", str(model), "--output", str(out), "--quiet", *extra]


def test_requantization_is_refused(capsys, q4_1_gguf, tmp_path):
    """A clean refusal (exit 2, one error line, nothing written) naming the source's types,
    the targets' and the loss."""
    from test_cli_compile import assert_clean_failure

    out = tmp_path / "out"
    # q4_0 (4.5 bpw) below Q4_1 (5 bpw) for all but the head (q6k -> q8_0 at 64 columns)
    message = (
        "--quant q4_0 would requantize 16 tensor(s) that the GGUF source already stores "
        "quantized: source tensors are 16 x Q4_1 (5 bpw); requantized to 15 x q4_0 (4.5 bpw), "
        "1 x q8_0 (8.5 bpw). Quantizing rounded weights again loses precision twice (the "
        "source's rounding error plus the new format's); 15 of them would get no more bits "
        "than they have. Pass --allow-requantize to accept the loss"
    )
    assert_clean_failure(capsys, out, compile_argv(q4_1_gguf, out, "--quant", "q4_0"), message)
    # Q4_K_M at 64 columns: q4k -> q5_0 (5.5 bpw), q6k -> q8_0: more bits, still refused
    message = (
        "requantized to 13 x q5_0 (5.5 bpw), 3 x q8_0 (8.5 bpw). Quantizing rounded weights "
        "again loses precision twice (the source's rounding error plus the new format's); "
        "more bits cannot bring back what the source's rounding lost."
    )
    argv = compile_argv(q4_1_gguf, out, "--quant", "Q4_K_M")
    assert_clean_failure(capsys, out, argv, message)


def test_requantization_guard_per_tensor(q4_1_gguf):
    """Keeping a tensor's own type is a copy, not a requantization; decoding to float is
    lossless; --allow-requantize lets the rest through."""
    from tallow.compiler.gguf_source import gguf_source
    from tallow.model_defs.registry import get_architecture
    from tallow.runtime.errors import ModelSourceError

    source = gguf_source(str(q4_1_gguf), q4_1_gguf)
    arch = get_architecture(source.config)
    ckpt = source.open_checkpoint()
    weight_map = source.weight_map(arch, arch.config_from_hf(source.config))

    def plan(quant, **kw):
        return make_plan(quant, "f32", weight_map, ckpt.shape, ckpt.source_type, **kw)

    kept = plan("q4_1:all")  # every tensor already q4_1: blocks copied
    assert kept.reused == set(kept.types) and len(kept.types) == 10
    assert plan("f32").types == {}  # dequantized: nothing requantized
    with pytest.raises(ModelSourceError, match="--quant q4_1 would requantize 1 tensor") as e:
        plan("q4_1")  # the mix's head at q8_0 (q6k's fallback); the embedding stays q4_1
    assert "more bits cannot bring back" in str(e.value)
    allowed = plan("q4_0", allow_requantize=True)
    assert set(allowed.types.values()) == {"q4_0", "q8_0"} and not allowed.reused


def test_allow_requantize_from_the_command_line(monkeypatch, q4_1_gguf, tmp_path):
    """--allow-requantize reaches the plan: the compile plans the requantization (stopped
    after planning here; a whole compile of a planned mix is test_quant_model's)."""
    from tallow.cli.main import main
    from tallow.compiler import phases, pipeline
    from tallow.runtime.errors import TallowError

    planned = {}

    def stop(state):
        planned["plan"] = state.quant_plan
        raise TallowError("stopped after planning")

    monkeypatch.setattr(
        pipeline, "_phases", lambda targets: [("read", phases.read_config), ("stop", stop)]
    )
    out = tmp_path / "out"
    argv = compile_argv(q4_1_gguf, out, "--quant", "q4_0", "--allow-requantize")
    assert main(argv) == 2
    plan = planned["plan"]
    assert plan.label == "q4_0" and set(plan.types.values()) == {"q4_0", "q8_0"}
    # Nothing is left: neither the partial folder nor the output folder the compile made.
    assert not plan.reused and not out.exists()


def _moe_shapes(n_layer: int, experts: int) -> dict:
    """A MoE model's GGUF tensors: attention, router, stacked experts [experts, rows, cols]."""
    shapes = {"token_embd.weight": (320, 256), "output.weight": (320, 256)}
    for i in range(n_layer):
        b = f"blk.{i}"
        shapes |= {f"{b}.attn_q.weight": (256, 256), f"{b}.attn_k.weight": (64, 256)}
        shapes |= {f"{b}.attn_v.weight": (64, 256), f"{b}.attn_output.weight": (256, 256)}
        shapes[f"{b}.ffn_gate_inp.weight"] = (experts, 256)
        shapes[f"{b}.ffn_gate_exps.weight"] = (experts, 512, 256)
        shapes[f"{b}.ffn_up_exps.weight"] = (experts, 512, 256)
        shapes[f"{b}.ffn_down_exps.weight"] = (experts, 256, 512)
    return shapes


@pytest.mark.parametrize("experts", [8, 16])
def test_expert_stacks_take_their_roles_rules(experts):
    """llama.cpp (llama-quant.cpp) matches roles by name, so `ffn_down_exps` is ffn_down
    (q6k in the "more bits" layers of Q4_K_M: 2 and 3 of 4); the router is never
    quantized; an 8-expert model gets attn_v and attn_k in q8_0 and attn_output in q5k."""
    got = find_mix("Q4_K_M").types(_moe_shapes(4, experts))
    assert "blk.0.ffn_gate_inp.weight" not in got
    for i in range(4):
        b = f"blk.{i}"
        assert got[f"{b}.ffn_gate_exps.weight"] == got[f"{b}.ffn_up_exps.weight"] == "q4k"
        assert got[f"{b}.ffn_down_exps.weight"] == ("q6k" if i >= 2 else "q4k")
        if experts == 8:
            assert got[f"{b}.attn_v.weight"] == got[f"{b}.attn_k.weight"] == "q8_0"
            assert got[f"{b}.attn_output.weight"] == "q5k"
        else:
            assert got[f"{b}.attn_v.weight"] == ("q6k" if i >= 2 else "q4k")
            assert got[f"{b}.attn_k.weight"] == got[f"{b}.attn_output.weight"] == "q4k"
    # Q3_K_L's own attn_output rule (q5k) does not apply to 8 experts (llama.cpp's order)
    q3l = find_mix("Q3_K_L").types(_moe_shapes(4, 8))
    assert q3l["blk.0.attn_output.weight"] == "q3k"


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_plan_quantizes_expert_stacks_from_either_source(source):
    """One source tensor per expert (safetensors) or one stack (GGUF): the stacked
    parameter gets one type, the stack's, with rows the block does not divide falling back."""
    from tallow.model_defs.qwen_moe import qwen3_moe_from_hf
    from tallow.model_defs.registry import get_architecture

    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "intermediate_size": 96,
        "tie_word_embeddings": False,
    }
    config = qwen3_moe_from_hf(cfg)
    arch = get_architecture(cfg)
    wmap = (arch.hf_weight_map if source == "hf" else arch.gguf_weight_map)(config)

    def shape_of(name: str):
        if "exps" in name:  # a GGUF stack, read as [experts * rows, cols]
            return (8 * 96, 256) if "down" not in name else (8 * 256, 96)
        if ".experts." in name:
            return (96, 256) if "down" not in name else (256, 96)
        return (256, 256)

    plan = make_plan("q4k_m", "f32", wmap, shape_of, lambda _: "float", num_experts=8)
    p = "model.layers.1.mlp.experts"
    # gate/up rows of 256: q4k; down rows of 96: q4k's fallback q5_0, and in the "more
    # bits" layer 1 of 2 q6k's fallback q8_0
    assert plan.qtype(f"{p}.gate_proj") == plan.qtype(f"{p}.up_proj") == "q4k"
    assert plan.qtype(f"{p}.down_proj") == "q8_0"
    assert plan.qtype("model.layers.0.mlp.experts.down_proj") == "q5_0"
    assert plan.qtype("model.layers.0.mlp.gate.weight") == FLOAT


@pytest.mark.parametrize("file_type", [None, "MOSTLY_Q4_K_M"])
def test_kept_types_are_named_by_the_files_type(tiny_model_dir, tmp_path, file_type):
    """A GGUF compiled in its own types is named by the quantization it declares
    (`general.file_type`, as llama.cpp writes it: Q4_K_M), not by its most common tensor
    type (Q4_K_M's is q5_0 or q4_k by shape); a file declaring none keeps the most common."""
    import gguf
    from gguf_models import write_gguf

    from tallow.compiler.gguf_source import gguf_source
    from tallow.model_defs.registry import get_architecture

    # most tensors q5_0, some q8_0: a Q4_K_M file's fallbacks at rows q4k's 256 cannot divide
    types = {f"blk.{i}.{r}.weight": "q5_0" for i in range(2) for r in LINEAR}
    types.update({"blk.0.attn_v.weight": "q8_0", "output.weight": "q8_0"})

    def declare(writer, _cfg):
        if file_type is not None:
            writer.add_file_type(gguf.LlamaFileType[file_type])

    path = write_gguf(
        tiny_model_dir("qwen3"),
        tmp_path / "m.gguf",
        "qwen3",
        tensor_types=types,
        metadata_fn=declare,
    )
    source = gguf_source(str(path), path)
    arch = get_architecture(source.config)
    ckpt = source.open_checkpoint()
    weight_map = source.weight_map(arch, arch.config_from_hf(source.config))
    kept = make_plan(
        None, "f32", weight_map, ckpt.shape, ckpt.source_type, file_type=source.file_type
    )
    assert source.file_type == (file_type and "q4_k_m")
    assert kept.label == ("q4_k_m" if file_type else "q5_0")
    assert {kept.qtype(p) for p in kept.types} == {"q5_0", "q8_0"}  # the types stay kept
    chosen = make_plan(
        "q8_0",
        "f32",
        weight_map,
        ckpt.shape,
        ckpt.source_type,
        allow_requantize=True,
        file_type=source.file_type,
    )
    assert chosen.label == "q8_0"  # a --quant mix names itself
