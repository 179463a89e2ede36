"""The lattice i-quants IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS, IQ1_S, IQ1_M
(compiler/quant/grids): decoders, refusals, a whole model.

Oracles: `gguf.quants.dequantize` for the numpy and the TIR decoders, on arbitrary block
bytes and on every byte value at every position (the f16 scale drawn from finite values so
results compare bit for bit); transformers on a model whose weights are the GGUF's blocks as
`gguf` dequantizes them. The tests parametrised over the registry (test_quant_kernels,
test_quant_half, test_quant_registry) cover these formats too, on random valid blocks
(`quant_blocks.weight_blocks`: tallow has no quantizer for them).
"""

from __future__ import annotations

import contextlib

import gguf
import numpy as np
import pytest
from quant_blocks import set_scale
from test_int8_decode import HAS_VNNI
from test_iquants import F16_EDGES, PROMPTS, _dequantized_twin

from tallow.compiler.quant import QUANT_FORMATS, dequantize, quantize

GRIDS = ["iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_s", "iq1_m"]


def _random_blocks(qtype: str, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (count, QUANT_FORMATS[qtype].type_size), dtype=np.uint8)
    d = rng.standard_normal(count).astype(np.float16)
    d[: len(F16_EDGES)] = F16_EDGES
    set_scale(raw, qtype, d)
    return raw


def _edge_blocks(qtype: str) -> np.ndarray:
    """Every byte value at every position (so every grid index, sign, scale and delta bit),
    under each extreme f16 scale (iq1_m's scale bits then overwrite their nibbles)."""
    size = QUANT_FORMATS[qtype].type_size
    shifts = (np.arange(size)[None, :] + np.arange(256)[:, None]) % 256
    blocks = np.concatenate([shifts.astype(np.uint8)] * len(F16_EDGES))
    set_scale(blocks, qtype, np.repeat(np.array(F16_EDGES, np.float16), 256))
    return blocks


def _decoded_by_gguf(qtype: str, blocks: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type).reshape(len(blocks), -1)


def test_edge_blocks_reach_every_byte_value():
    for qtype in GRIDS:
        b = _edge_blocks(qtype)
        seen = [len(np.unique(b[:, i])) for i in range(b.shape[1])]
        scale_bytes = {49, 51, 53, 55} if qtype == "iq1_m" else {0, 1}
        assert all(n == 256 for i, n in enumerate(seen) if i not in scale_bytes), qtype


@pytest.mark.parametrize("qtype", GRIDS)
def test_numpy_decoder_is_gguf_bit_for_bit(qtype):
    for blocks in (_random_blocks(qtype, 512, seed=1), _edge_blocks(qtype)):
        ours = dequantize(blocks, qtype, (len(blocks), 256))
        ref = _decoded_by_gguf(qtype, blocks)
        np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", GRIDS)
def test_tir_decoder_is_gguf_bit_for_bit(qtype):
    """The TE dequantization with the grid as a constant input (what the fused kernels and
    the embedding lookup decode through) on the same blocks."""
    import tvm
    from tvm import te

    from tallow.model_defs.quant_ops import dequantize_te

    fmt = QUANT_FORMATS[qtype]
    blocks = np.concatenate([_random_blocks(qtype, 64, seed=2), _edge_blocks(qtype)])
    rows = len(blocks)
    w = te.placeholder((rows, fmt.type_size), "uint8", name="w")
    grid = fmt.table()
    t = te.placeholder(grid.shape, "uint8", name="grid")
    func = te.create_prim_func([w, t, dequantize_te(w, qtype, rows, 256, table=t)])
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.empty((rows, 256), "float32")
    lib["main"](tvm.runtime.tensor(blocks), tvm.runtime.tensor(np.array(grid)), out)
    ref = _decoded_by_gguf(qtype, blocks)
    np.testing.assert_array_equal(out.numpy().view(np.uint32), ref.view(np.uint32))


def test_grids_come_from_gguf():
    """Sizes and value sets of the grids as llama.cpp defines them (entries x width)."""
    from tallow.compiler.quant.grids.tables import grid_bytes

    want = {
        "iq2_xxs": (256 * 8, {8, 25, 43}),
        "iq2_xs": (512 * 8, {8, 25, 43}),
        "iq2_s": (1024 * 8, {8, 25, 43}),
        "iq3_xxs": (256 * 4, {4, 12, 20, 28, 36, 44, 52, 62}),
        "iq3_s": (512 * 4, set(range(1, 16, 2))),
        "iq1_s": (2048 * 8, {0, 1, 2}),
        "iq1_m": (2048 * 8, {0, 1, 2}),
    }
    for qtype, (size, values) in want.items():
        grid = grid_bytes(qtype)
        assert grid.shape == (size,) and set(np.unique(grid)) == values, qtype


@pytest.mark.parametrize("qtype", [q for q in GRIDS if not q.startswith("iq3")])
def test_no_quantizer_refused_in_one_line(qtype):
    """tallow reads the 1- and 2-bit lattice types but does not write them: `quantize` and
    `--quant` (alone or FORMAT:all) refuse in one line, naming the importance matrix that
    llama.cpp's recipes need."""
    from tallow.compiler.quant_plan import check_quant_option, quant_choices
    from tallow.runtime.errors import TargetError

    why = "importance matrix"
    with pytest.raises(ValueError, match=why):
        quantize(np.zeros((1, 256), np.float32), qtype)
    for name in (qtype, f"{qtype}:all", qtype.upper()):
        with pytest.raises(TargetError, match=why) as err:
            check_quant_option(name, "f32")
        assert "\n" not in str(err.value)
    assert qtype not in quant_choices() and f"{qtype}:all" not in quant_choices()


def test_gpu_compile_refuses_the_grid_types(tiny_model_dir, tmp_path):
    from gguf_models import write_gguf

    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.errors import TargetError

    src = tiny_model_dir("qwen2_wide")
    types = {"blk.0.attn_q.weight": "iq2_xxs"}
    path = write_gguf(src, tmp_path / "iq2.gguf", "qwen2", tensor_types=types)
    opts = CompileOptions(model=str(path), target="cuda", output=tmp_path / "a", quiet=True)
    with pytest.raises(TargetError, match=r"qkv_proj.* IQ2_XXS, a block type the GPU"):
        compile_model(opts)
    assert not (tmp_path / "a").exists()


def test_moe_experts_in_a_grid_type_are_refused():
    """The MoE grouped kernels do not take the lattice i-quants: building the experts stops
    in one line naming the stack and its type (a dense layer of the same type builds)."""
    from tallow.model_defs.moe import MoEExperts
    from tallow.model_defs.quant_ops import QuantLinear
    from tallow.runtime.errors import ModelSourceError

    types = {"gate_proj": "q4k", "up_proj": "q4k", "down_proj": "iq2_xs"}
    with pytest.raises(ModelSourceError, match=r"down_proj are IQ2_XS: the MoE") as err:
        MoEExperts(4, 256, 256, "float32", types)
    assert "\n" not in str(err.value)
    QuantLinear(256, 64, "iq2_xs")


# --- a whole model -------------------------------------------------------------------------

# qwen2_wide (rows of 256 and 512 weights): the seven types over the matrices, the
# embedding (a lookup through the grid) and the head included, fused projections holding
# runs of different types
GRID_TYPES = {
    "token_embd.weight": "iq3_s",
    "output.weight": "iq2_xxs",
    **{f"blk.{i}.attn_q.weight": "iq3_xxs" for i in range(2)},
    **{f"blk.{i}.attn_k.weight": "iq2_s" for i in range(2)},
    **{f"blk.{i}.attn_v.weight": "iq2_xs" for i in range(2)},
    **{f"blk.{i}.attn_output.weight": "iq1_s" for i in range(2)},
    **{f"blk.{i}.ffn_gate.weight": "iq1_m" for i in range(2)},
    **{f"blk.{i}.ffn_up.weight": "iq3_s" for i in range(2)},
    **{f"blk.{i}.ffn_down.weight": "iq2_xxs" for i in range(2)},
}


@contextlib.contextmanager
def _rounding_linears(float_weights: set):
    """While open, every `F.linear` of transformers rounds its input rows as the int8 kernels
    do (`test_int8_decode._round_activations`), but those of the weights whose id is in
    `float_weights`."""
    import torch
    from test_int8_decode import _round_activations

    functional = torch.nn.functional
    float_linear = functional.linear

    def linear(x, w, b=None):
        if id(w) in float_weights:
            return float_linear(x, w, b)
        rows = x.detach().reshape(-1, x.shape[-1]).numpy().astype(np.float32)
        values, _ = _round_activations(rows)
        return float_linear(torch.from_numpy(values.astype(np.float32)).reshape(x.shape), w, b)

    functional.linear = linear
    try:
        yield
    finally:
        functional.linear = float_linear


@pytest.mark.slow
@pytest.mark.parametrize(
    "cpu",
    [
        None,
        pytest.param(
            ["x86-64-v3"],
            marks=pytest.mark.skipif(
                not HAS_VNNI, reason="native is the AVX2 build here: the case above"
            ),
        ),
    ],
    ids=["native", "x86-64-v3"],
)
def test_grid_gguf_matches_transformers(tiny_model_dir, tmp_path, cpu):
    """A GGUF whose matrices are the seven lattice i-quants (random valid blocks, about the
    model's weights' size) compiles for this CPU (and, on an AVX-512 VNNI host, for AVX2:
    `--cpu x86-64-v3`, whose prefill takes `int8_prefill_columns`' tiles) with every tensor
    in its own type, and its
    logits are transformers' on the weights `gguf` decodes from those bytes: the prompts'
    prefill to float32 rounding (float activations; on AVX-512 VNNI int8 ones, within their
    rounding); a batched decode step and a lone
    sequence's, whose matmuls in these types but iq1_m take the int8-activation kernels
    (`compiler/quant/grids/int8_groups.py`), within the rounding of the activations."""
    import torch
    import yaml
    from gguf_models import write_gguf

    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    from tiny_models import load_hf

    src = tiny_model_dir("qwen2_wide")
    path = write_gguf(src, tmp_path / "grid.gguf", "qwen2", tensor_types=GRID_TYPES)
    art = compile_model(CompileOptions(model=str(path), output=tmp_path / "a", cpu=cpu, quiet=True))
    manifest = yaml.safe_load((art / "manifest.yaml").read_text())
    stored = {p["name"]: p["quant"] for p in manifest["params"]}
    assert stored["lm_head.weight"] == "iq2_xxs"
    assert stored["model.embed_tokens.weight"] == "iq3_s"
    qkv = "model.layers.0.self_attn.qkv_proj"
    runs = [stored[f"{qkv}.runs.{i}.weight"] for i in range(3)]
    assert runs == ["iq3_xxs", "iq2_s", "iq2_xs"]
    assert set(stored.values()) == {*GRID_TYPES.values(), "none"}

    hf = load_hf(_dequantized_twin(src, path, tmp_path / "twin"))
    runner = TVMModelRunner(art, kv=KVCacheConfig(4, 512, 64))
    for i in range(len(PROMPTS)):
        runner.add_sequence(i)
    got = runner.forward(list(enumerate(PROMPTS)))
    (library,) = manifest["libraries"]
    # prefill takes int8 activations for these types on AVX-512 VNNI and AVX2 (the tiles of
    # `int8_prefill`, `int8_prefill_columns`; float where neither): then the oracle's prefill
    # rounds the inputs of every linear but iq1_m's (float
    # kernels), and so builds the KV cache the decode steps below read. Measured 2026-12-06
    # (Intel Xeon): 0.10 of logits up to 13.6, against 1.11 from a prefill without rounding
    int8_prefill = library["details"].get("prefill_activations") == "int8_g32_row_step"
    assert int8_prefill or cpu is None  # the AVX2 build: the column tiles
    iq1_m = {id(layer.mlp.gate_proj.weight) for layer in hf.model.layers}
    rounding = _rounding_linears(iq1_m) if int8_prefill else contextlib.nullcontext()
    with rounding, torch.no_grad():
        outs = [hf(torch.tensor([p]), use_cache=True) for p in PROMPTS]
    want = np.stack([o.logits[0, -1].numpy() for o in outs])
    assert np.abs(got - want).max() <= (0.02 if int8_prefill else 1e-4) * np.abs(want).max()
    assert library["details"]["int8_decode_kernels"] > 0  # the IQ3_S ones
    nxt = [int(w.argmax()) for w in want]
    got = runner.forward([(i, [t]) for i, t in enumerate(nxt)])
    with torch.no_grad():
        want = np.stack(
            [
                hf(torch.tensor([[t]]), past_key_values=o.past_key_values).logits[0, -1].numpy()
                for t, o in zip(nxt, outs, strict=True)
            ]
        )
    # activations rounded to 8 bits: the bound of tests/test_int8_decode.py's model test
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    runner.add_sequence(99)  # one sequence alone: `decode`'s one-row kernels
    runner.forward([(99, PROMPTS[0])])
    alone = runner.forward([(99, [nxt[0]])])[0]
    assert np.abs(alone - want[0]).max() <= 0.05 * np.abs(want[0]).max()
