"""TQ1_0, TQ2_0 and MXFP4 (compiler/quant/lowbit): decoders, quantizers, a whole model (with
Q1_0 and NVFP4 in it too; their codecs are checked in test_llamacpp_blocks.py).

Oracles: `gguf.quants.dequantize` for every decoder (numpy and TIR) on arbitrary block bytes
and on every value of every field; `gguf.quants.quantize` for the quantizers (the package
has its own for these three); transformers on a model whose weights are the GGUF's blocks as
`gguf` dequantizes them. The tests parametrised over the registry (test_quantizers,
test_quant_kernels, test_int8_decode for tq2_0 and mxfp4, test_moe_kernels,
test_opencl_kernels' every-format case, ...) cover these three as well.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from quant_blocks import tir_dequantize
from test_iquants import F16_EDGES, PROMPTS, ROUNDING_NUDGE, _dequantized_twin, _oracle_steps

from tallow.compiler.quant import QUANT_FORMATS, dequantize, quantize
from tallow.compiler.quant.mixes import find_mix

LOWBIT = ["tq1_0", "tq2_0", "mxfp4"]
D_AT = {"tq1_0": 52, "tq2_0": 64}  # the TQ types' f16 d follows their codes


def _random_blocks(qtype: str, count: int, seed: int) -> np.ndarray:
    """Arbitrary bytes in every field (TQ codes beyond the valid digits included: they
    decode by the same arithmetic); a TQ `d` drawn from finite f16 values, extremes and
    subnormals first, so that results compare bit for bit. MXFP4's exponent byte is any."""
    fmt = QUANT_FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (count, fmt.type_size), dtype=np.uint8)
    if qtype in D_AT:
        d = rng.standard_normal(count).astype(np.float16)
        d[: len(F16_EDGES)] = F16_EDGES
        raw[:, D_AT[qtype] :] = d.view(np.uint8).reshape(count, 2)
    return raw


def _edge_blocks(qtype: str) -> np.ndarray:
    """TQ: every byte value at every code position, under each extreme f16 `d`. MXFP4: every
    exponent 0..255 (the subnormal scales 0 and 1, and 255 whose products overflow to inf),
    each with every code at every position."""
    fmt = QUANT_FORMATS[qtype]
    if qtype == "mxfp4":
        e = np.arange(256)
        idx = (np.arange(32)[None, :] + e[:, None]) % 16
        codes = idx[:, :16] | (idx[:, 16:] << 4)
        return np.concatenate([e[:, None], codes], axis=1).astype(np.uint8)
    at = D_AT[qtype]
    blocks = []
    for d in F16_EDGES:
        for shift in range(256):
            b = np.zeros(fmt.type_size, np.uint8)
            b[:at] = (np.arange(at) + shift) % 256  # over the shifts: every byte value
            b[at:] = np.array([d], np.float16).view(np.uint8)
            blocks.append(b)
    return np.stack(blocks)


def _decoded_by_gguf(qtype: str, blocks: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        out = gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type)
    return out.reshape(len(blocks), -1)


def test_edge_blocks_reach_every_field_value():
    for qtype, at in D_AT.items():
        codes = _edge_blocks(qtype)[:, :at]
        assert all(set(np.unique(codes[:, i])) == set(range(256)) for i in range(at))
    mx = _edge_blocks("mxfp4")
    assert set(mx[:, 0]) == set(range(256))
    assert set(np.unique(mx[:, 1:] & 15)) == set(range(16)) == set(np.unique(mx[:, 1:] >> 4))


@pytest.mark.parametrize("qtype", LOWBIT)
def test_numpy_decoder_is_gguf_bit_for_bit(qtype):
    for blocks in (_random_blocks(qtype, 512, seed=1), _edge_blocks(qtype)):
        n = QUANT_FORMATS[qtype].block_size
        ours = dequantize(blocks, qtype, (len(blocks), n))
        ref = _decoded_by_gguf(qtype, blocks)
        np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", LOWBIT)
def test_tir_decoder_is_gguf_bit_for_bit(qtype):
    """The TE dequantization (`quant_ops.dequantize_te`, the decoder of every fused
    dequantize-matmul) on the same arbitrary and extreme blocks."""
    blocks = np.concatenate([_random_blocks(qtype, 64, seed=2), _edge_blocks(qtype)])
    out = tir_dequantize(blocks, qtype)
    ref = _decoded_by_gguf(qtype, blocks)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", LOWBIT)
def test_quantizer_is_gguf_byte_for_byte(qtype):
    """On Gaussian weights and on LLM-sized ones (std 0.02) our blocks are `gguf`'s own."""
    x = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32)
    for data in (x, x * np.float32(0.02)):
        ref = gguf.quants.quantize(data, QUANT_FORMATS[qtype].ggml_type)
        np.testing.assert_array_equal(quantize(data, qtype), ref.reshape(64, -1))


def test_ternary_weights_round_trip_exactly():
    """What the TQ types are for: a ternary-trained matrix (values -s, 0, s per block, s an
    f16) is stored without loss; and MXFP4 stores E2M1 values times a power of two."""
    rng = np.random.default_rng(4)
    s = rng.uniform(0.01, 0.1, (32, 1)).astype(np.float16).astype(np.float32)
    w = (rng.integers(-1, 2, (32, 256)) * s).astype(np.float32)
    w[:, 0] = s[:, 0]  # every block holds s itself: d = s
    for qtype in ("tq1_0", "tq2_0"):
        np.testing.assert_array_equal(dequantize(quantize(w, qtype), qtype, w.shape), w)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    m = rng.choice(e2m1, (32, 256)) * rng.choice([-1, 1], (32, 256))
    m[:, ::32] = 6.0  # every block's largest magnitude is 6: scale 1
    m = (m * np.float32(2.0**-5)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(quantize(m, "mxfp4"), "mxfp4", m.shape), m)


def test_tq_falls_back_to_q4_0():
    """Rows not a multiple of 256 take q4_0, as llama.cpp's quantize does for the TQ types;
    MXFP4's 32-weight block has no fallback (rows not a multiple of 32 stay float)."""
    shapes = {"blk.0.attn_q.weight": (64, 256), "blk.0.attn_k.weight": (64, 96)}
    assert find_mix("tq2_0").types(shapes) == {
        "blk.0.attn_q.weight": "tq2_0",
        "blk.0.attn_k.weight": "q4_0",
    }
    assert find_mix("tq1_0").types(shapes)["blk.0.attn_k.weight"] == "q4_0"
    odd = {"blk.0.attn_q.weight": (64, 96), "blk.0.attn_k.weight": (64, 40)}
    assert find_mix("mxfp4").types(odd) == {
        "blk.0.attn_q.weight": "mxfp4",
        "blk.0.attn_k.weight": "none",
    }


@pytest.mark.parametrize("target", ["cuda", "metal"])
def test_gpu_compile_refuses_what_the_gpu_schedules_do_not_take(target, tiny_model_dir, tmp_path):
    """tq1_0 and mxfp4 do not go through the GPU schedules (`QuantFormat.gpu`): a GPU
    compile stops in one line naming the weight and its type, before building anything;
    tq2_0 does go through (`test_opencl_kernels`) and is not refused."""
    from gguf_models import write_gguf

    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.errors import TargetError

    assert [q for q in LOWBIT if not QUANT_FORMATS[q].gpu] == ["tq1_0", "mxfp4"]
    src = tiny_model_dir("qwen2_wide")
    types = {"blk.1.ffn_down.weight": "mxfp4", "blk.0.ffn_up.weight": "tq2_0"}
    path = write_gguf(src, tmp_path / "mx.gguf", "qwen2", tensor_types=types)
    opts = CompileOptions(model=str(path), target=target, output=tmp_path / "a", quiet=True)
    with pytest.raises(TargetError, match=r"model\.layers\.1\.mlp\.down_proj.* MXFP4") as err:
        compile_model(opts)
    assert "\n" not in str(err.value) and not (tmp_path / "a").exists()


# --- a whole model -------------------------------------------------------------------------

# qwen2_wide (every row length a multiple of 256), the three types spread over the matrices
# so that the fused projections hold runs of different types, the embedding (a quantized
# lookup) and the head included
LOWBIT_TYPES = {
    "token_embd.weight": "tq2_0",
    "output.weight": "mxfp4",
    "blk.0.attn_q.weight": "tq1_0",
    "blk.1.attn_q.weight": "q1_0",  # and NVFP4 (tests/test_llamacpp_blocks.py): their
    "blk.1.ffn_gate.weight": "nvfp4",  # decoders are checked against llama.cpp's own
    **{f"blk.{i}.attn_k.weight": "mxfp4" for i in range(2)},
    **{f"blk.{i}.attn_v.weight": "tq2_0" for i in range(2)},
    **{f"blk.{i}.attn_output.weight": "mxfp4" for i in range(2)},
    "blk.0.ffn_gate.weight": "tq2_0",
    **{f"blk.{i}.ffn_up.weight": "tq1_0" for i in range(2)},
    **{f"blk.{i}.ffn_down.weight": "mxfp4" for i in range(2)},
}


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_lowbit_gguf_matches_transformers(activations, tiny_model_dir, tmp_path):
    """A GGUF whose matrices are TQ1_0, TQ2_0 and MXFP4 compiles with every tensor in its
    own type, and its logits are transformers' on the weights `gguf` decodes from those
    bytes, for the prompts' prefill and 3 decode steps (the tolerances and the int8
    rounding oracle of `test_iquants.test_iquant_gguf_matches_transformers`).

    `int8` (AVX2: decode and prefill round activations to int8) puts every matrix in mxfp4 (the
    embedding stays tq2_0, a lookup): the TQ types have no int8 kernels and keep float
    activations, which the rounding oracle (every linear rounded) does not model."""
    import yaml
    from gguf_models import write_gguf

    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.compiler.target import resolve_target
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner
    from tallow.schedules.cpu import int8_gemv

    from tiny_models import load_hf

    avx2 = int8_gemv.supported(resolve_target("cpu", "f32").tvm())
    if activations == "int8" and not avx2:
        pytest.skip("this CPU has no AVX2: decode keeps float activations")
    levels = ["x86-64-v2"] if activations == "float" else ["x86-64-v3"]
    types = LOWBIT_TYPES
    if activations == "int8":
        types = {k: "tq2_0" if k == "token_embd.weight" else "mxfp4" for k in types}
    src = tiny_model_dir("qwen2_wide")
    path = write_gguf(src, tmp_path / "lowbit.gguf", "qwen2", tensor_types=types)
    art = compile_model(
        CompileOptions(model=str(path), output=tmp_path / "a", quiet=True, cpu=levels)
    )
    manifest = yaml.safe_load((art / "manifest.yaml").read_text())
    stored = {p["name"]: p["quant"] for p in manifest["params"]}
    assert stored["lm_head.weight"] == "mxfp4"
    assert stored["model.embed_tokens.weight"] == "tq2_0"
    if activations == "float":
        qkv = "model.layers.0.self_attn.qkv_proj"
        runs = [stored[f"{qkv}.runs.{i}.weight"] for i in range(3)]
        assert runs == ["tq1_0", "mxfp4", "tq2_0"]
    assert set(stored.values()) == {*types.values(), "none"}
    (library,) = manifest["libraries"]
    int8 = library["details"].get("decode_activations") == "int8_g32_row_step"
    int8_prefill = library["details"].get("prefill_activations") == "int8_g32_row_step"
    assert int8 == (activations == "int8") == int8_prefill  # mxfp4: the signed column tiles

    hf = load_hf(_dequantized_twin(src, path, tmp_path / "twin"))
    refs, tokens = _oracle_steps(hf, PROMPTS, 3, int8, round_prefill=int8_prefill)
    spreads = [0.0] * len(refs)
    if int8:
        nudged, same = _oracle_steps(hf, PROMPTS, 3, True, ROUNDING_NUDGE, int8_prefill)
        assert same == tokens  # the oracle's own choices do not hang on the rounding
        spreads = [float(np.abs(a - b).max()) for a, b in zip(nudged, refs, strict=True)]
    runner = TVMModelRunner(art, kv=KVCacheConfig(4, 512, 64))
    for i in range(len(PROMPTS)):
        runner.add_sequence(i)
    got = [runner.forward(list(enumerate(PROMPTS)))]
    for step in range(3):
        feed = tokens[step * len(PROMPTS) : (step + 1) * len(PROMPTS)]
        got.append(runner.forward([(i, [t]) for i, t in feed]))
    for step, (g, r) in enumerate(zip(got, refs, strict=True)):
        scale = float(np.abs(r).max())
        bound = 1e-5 * scale + spreads[step] if int8 else 1e-4 * scale
        assert np.abs(g - r).max() <= bound, (step, float(np.abs(g - r).max()), bound)
