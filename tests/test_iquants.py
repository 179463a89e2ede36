"""The i-quants iq4_nl and iq4_xs (compiler/quant/iquants): decoders, quantizer, a whole model.

Oracles: `gguf.quants.dequantize` (the `gguf` package's decoders) for every decoder, on
arbitrary block bytes and on the fields' extreme values; the round-trip error of the legacy
and K-quant formats of about the same size on the same data; transformers on a model whose
weights are the GGUF's blocks as `gguf` dequantizes them. Every test parametrised over the
registered formats (test_quantizers, test_quant_kernels, test_int8_decode, test_moe_kernels,
test_opencl_kernels, ...) covers these two as well.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from quant_blocks import tir_dequantize

from tallow.compiler.quant import QUANT_FORMATS, dequantize, quantize
from tallow.compiler.quant.mixes import find_mix

IQUANTS = ["iq4_nl", "iq4_xs"]
ROUNDING_NUDGE = 1e-5  # see test_iquant_gguf_matches_transformers
F16_EDGES = [0.0, -0.0, 65504.0, -65504.0, 2.0**-24, -(2.0**-24), 2.0**-14, 1.0, -3.5]


def _random_blocks(qtype: str, count: int, seed: int) -> np.ndarray:
    """Arbitrary bytes in every field, the f16 `d` drawn from finite values (extremes,
    subnormals, signed zeros) so that results compare bit for bit."""
    fmt = QUANT_FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (count, fmt.type_size), dtype=np.uint8)
    d = rng.standard_normal(count).astype(np.float16)
    d[: len(F16_EDGES)] = F16_EDGES
    raw[:, 0:2] = d.view(np.uint8).reshape(count, 2)
    return raw


def _edge_blocks(qtype: str) -> np.ndarray:
    """Every index 0..15 at every position, and for iq4_xs every 6-bit group scale 0..63 (the
    scale fields set byte by byte), under the extreme f16 scales."""
    fmt = QUANT_FORMATS[qtype]
    blocks = []
    for d in F16_EDGES:
        for shift in range(16):
            b = np.zeros(fmt.type_size, np.uint8)
            b[0:2] = np.array([d], np.float16).view(np.uint8)
            codes_at = 2 if qtype == "iq4_nl" else 8
            idx = (np.arange(2 * (fmt.type_size - codes_at)) + shift) % 16
            b[codes_at:] = idx[0::2] | (idx[1::2] << 4)
            if qtype == "iq4_xs":
                ls = (np.arange(8) * 8 + shift) % 64  # over the shifts: all of 0..63
                b[4:8] = (ls[0::2] & 15) | ((ls[1::2] & 15) << 4)
                high = sum(int(v >> 4) << (2 * g) for g, v in enumerate(ls))
                b[2:4] = np.array([high], "<u2").view(np.uint8)
            blocks.append(b)
    return np.stack(blocks)


def _decoded_by_gguf(qtype: str, blocks: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type).reshape(len(blocks), -1)


@pytest.mark.parametrize("qtype", IQUANTS)
def test_numpy_decoder_is_gguf_bit_for_bit(qtype):
    for blocks in (_random_blocks(qtype, 512, seed=1), _edge_blocks(qtype)):
        n = QUANT_FORMATS[qtype].block_size
        ours = dequantize(blocks, qtype, (len(blocks), n))
        ref = _decoded_by_gguf(qtype, blocks)
        np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_edge_blocks_reach_every_field_value():
    """The edge blocks really hold every index and every iq4_xs group scale."""
    from tallow.compiler.quant.iquants.numpy_codec import xs_group_scales

    for qtype in IQUANTS:
        blocks = _edge_blocks(qtype)
        codes = blocks[:, 2 if qtype == "iq4_nl" else 8 :]
        assert set(np.unique(codes & 15)) == set(range(16)) == set(np.unique(codes >> 4))
    assert set(np.unique(xs_group_scales(_edge_blocks("iq4_xs")))) == set(range(-32, 32))


@pytest.mark.parametrize("qtype", IQUANTS)
def test_tir_decoder_is_gguf_bit_for_bit(qtype):
    """The TE dequantization (`quant_ops.dequantize_te`, the decoder of every fused
    dequantize-matmul) on the same arbitrary and extreme blocks."""
    blocks = np.concatenate([_random_blocks(qtype, 64, seed=2), _edge_blocks(qtype)])
    out = tir_dequantize(blocks, qtype)
    ref = _decoded_by_gguf(qtype, blocks)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


def _rel_rms(qtype: str, x: np.ndarray) -> float:
    y = dequantize(quantize(x, qtype), qtype, x.shape)
    return float(np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2)))


# Relative RMS round-trip error, 256 x 1024 weights, seed 5 (bits per weight: iq4_xs 4.25,
# iq4_nl, q4_0, q4k 4.5, q4_1 5.0). Measured:
#   normal      iq4_nl 7.30%  iq4_xs 7.38%  q4_0 8.57%   q4_1 7.80%   q4k 7.15%
#   student_t3  iq4_nl 9.81%  iq4_xs 9.95%  q4_0 12.76%  q4_1 10.05%  q4k 9.31%
#   uniform     iq4_nl 6.17%  iq4_xs 6.23%  q4_0 6.50%   q4_1 6.08%   q4k 5.51%
# The table suits bell-shaped weights (as trained weights are); on uniform data q4_1's and
# q4k's linear grids with a min win (not asserted).
@pytest.mark.parametrize("dist", ["normal", "student_t3"])
def test_roundtrip_error_comparable_to_q4_0_and_q4k(dist):
    rng = np.random.default_rng(5)
    shape = (256, 1024)
    x = {"normal": rng.standard_normal, "student_t3": lambda s: rng.standard_t(3, s)}[dist](shape)
    x = x.astype(np.float32)
    err = {q: _rel_rms(q, x) for q in ("iq4_nl", "iq4_xs", "q4_0", "q4_1", "q4k")}
    # the same 4.5 bits as q4_0 and fewer than q4_1's 5: better than both
    assert err["iq4_nl"] < err["q4_1"] < err["q4_0"], err
    # 4.25 bits against q4k's 4.5: within 10% of its error (1.03x, 1.07x), better than q4_0's
    assert err["iq4_xs"] < 1.10 * err["q4k"] and err["iq4_xs"] < err["q4_0"], err


@pytest.mark.parametrize("qtype", ["iq4_xs", "iq3_s", "iq3_xxs"])
def test_iq4_xs_falls_back_to_iq4_nl(qtype):
    """Rows not a multiple of 256 take iq4_nl, as llama.cpp's quantize does; rows not a
    multiple of 32 stay float."""
    shapes = {
        "blk.0.attn_q.weight": (64, 256),
        "blk.0.attn_k.weight": (64, 96),
        "blk.0.ffn_down.weight": (64, 40),
    }
    types = find_mix(qtype).types(shapes)
    assert types == {
        "blk.0.attn_q.weight": qtype,
        "blk.0.attn_k.weight": "iq4_nl",
        "blk.0.ffn_down.weight": "none",
    }


def test_unread_types_are_refused_naming_the_ones_read(tmp_path):
    """The GGUF check refuses a tensor of a block type tallow does not read (Q8_1, llama.cpp's
    internal activation type) in one message that lists the types it reads, every i-quant
    among them."""
    from tallow.compiler.gguf_source import check_gguf_file
    from tallow.runtime.errors import ModelSourceError

    path = tmp_path / "q8_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1][1]
    writer.add_tensor(
        "blk.0.attn_q.weight",
        np.zeros((2, size), np.uint8),
        raw_dtype=gguf.GGMLQuantizationType.Q8_1,
    )
    writer.add_tensor(
        "blk.0.attn_k.weight",
        np.zeros((2, 18), np.uint8),
        raw_dtype=QUANT_FORMATS["iq4_nl"].ggml_type,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelSourceError, match="Q8_1") as err:
        check_gguf_file(path)
    supported = str(err.value).split("supported: ")[-1].split(", ")
    iquants = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL"}
    lowbit = {"TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q1_0"}
    assert iquants | lowbit | {"IQ4_XS", "Q4_K", "Q8_0", "F16"} <= set(supported)
    assert "blk.0.attn_q.weight" in str(err.value) and "\n" not in str(err.value)


# --- a whole model -------------------------------------------------------------------------

# qwen2_wide (hidden 256, FFN 512: every row length a multiple of 256), its matrices split
# between the two formats so that fused projections hold runs of both, the embedding (a
# quantized lookup) and the head included
IQ_TYPES = {
    "token_embd.weight": "iq4_nl",
    "output.weight": "iq4_xs",
    **{f"blk.{i}.attn_q.weight": "iq4_xs" for i in range(2)},
    **{f"blk.{i}.attn_k.weight": "iq4_nl" for i in range(2)},
    **{f"blk.{i}.attn_v.weight": "iq4_xs" for i in range(2)},
    **{f"blk.{i}.attn_output.weight": "iq4_nl" for i in range(2)},
    **{f"blk.{i}.ffn_gate.weight": "iq4_nl" for i in range(2)},
    **{f"blk.{i}.ffn_up.weight": "iq4_xs" for i in range(2)},
    **{f"blk.{i}.ffn_down.weight": "iq4_xs" for i in range(2)},
}
PROMPTS = [[5, 17, 40, 3, 99, 250, 7], [11, 12, 13, 200, 201, 66, 8, 9, 10, 120, 44]]


def _dequantized_twin(src, gguf_path, dst):
    """A copy of the HF model folder whose weights are the GGUF's tensors as `gguf`
    dequantizes them (qwen2's GGUF rows are not permuted)."""
    import shutil

    from gguf_models import gguf_name
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    weights = load_file(src / "model.safetensors")
    for name, w in weights.items():
        t = tensors[gguf_name(name)]
        weights[name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def _rounding_linear(nudge: float = 0.0):
    """A context manager: while open, every `F.linear` of transformers rounds its input rows
    as the int8 decode kernels do (`test_int8_decode._round_activations`, the rule in numpy),
    after moving each input by `nudge` times its 32-group's largest magnitude, up and down
    in turn (as `test_models_moe.round_expert_inputs`)."""
    import contextlib

    import torch
    from test_int8_decode import _round_activations

    float_linear = torch.nn.functional.linear

    def rounded(x, w, b=None):
        groups = x.detach().reshape(-1, x.shape[-1] // 32, 32).numpy().astype(np.float32)
        top = np.abs(groups).max(axis=2, keepdims=True)
        signs = np.where(np.arange(groups.size).reshape(groups.shape) % 2, -1, 1)
        rows = (groups + np.float32(nudge) * top * signs).astype(np.float32)
        values, _ = _round_activations(rows.reshape(-1, x.shape[-1]))
        return float_linear(torch.from_numpy(values.astype(np.float32)).reshape(x.shape), w, b)

    @contextlib.contextmanager
    def patched():
        torch.nn.functional.linear = rounded
        try:
            yield
        finally:
            torch.nn.functional.linear = float_linear

    return patched()


def _oracle_steps(
    hf, prompts, steps: int, round_decode: bool, nudge: float = 0.0, round_prefill: bool = False
):
    """transformers' last-position logits: the prompts' prefill, then `steps` decode steps
    through its KV cache, each feeding the previous argmax; with `round_decode` (and
    `round_prefill`) the decode steps' (the prefill's) linear inputs are rounded as our int8
    kernels do."""
    import contextlib

    import torch

    out, caches, tokens = [], [], []
    with torch.no_grad():
        for p in prompts:
            with _rounding_linear(nudge) if round_prefill else contextlib.nullcontext():
                r = hf(torch.tensor([p]), use_cache=True)
            caches.append(r.past_key_values)
            out.append([r.logits[0, -1].numpy()])
        for _ in range(steps):
            for i in range(len(prompts)):
                tok = int(out[i][-1].argmax())
                tokens.append((i, tok))
                with _rounding_linear(nudge) if round_decode else contextlib.nullcontext():
                    r = hf(torch.tensor([[tok]]), past_key_values=caches[i], use_cache=True)
                caches[i] = r.past_key_values
                out[i].append(r.logits[0, -1].numpy())
    return [np.stack([o[s] for o in out]) for s in range(steps + 1)], tokens


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_iquant_gguf_matches_transformers(activations, tiny_model_dir, tmp_path):
    """A GGUF whose matrices are iq4_nl and iq4_xs compiles with every tensor in its own
    type (the GGUF's bytes kept), and its logits are transformers' on the weights `gguf`
    decodes from those bytes, for the prompts' prefill and 3 decode steps.

    `float`: built for x86-64-v2 (no AVX2: float activations in decode too): to float32
    rounding throughout (measured 1.3e-6 to 3.9e-6 of the largest logit). `int8`: the AVX2
    level, whose decode and (since the column tiles' sign trick) prefill matmuls round
    activations to int8 (`cpu.int8_ops`); the oracle rounds the inputs of its linears by the
    same rule. An input within float32 noise of a rounding boundary can take the next code
    on one side only, so each step's tolerance is what nudging the oracle's inputs by 1e-5
    of their group's largest value moves its own logits (`test_models_moe`'s measure).
    Measured (2026-12-05, decode only then, logits up to 13): errors 0.25, 0.12, 0.013
    within a spread of 0.36; against the oracle without the rounding 0.28, 0.61, 0.62. The
    same model with every matrix iq4_nl, or every one iq4_xs, met the rounding oracle to 4e-7
    of the largest logit (no code flipped)."""
    import yaml
    from gguf_models import write_gguf

    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.compiler.target import resolve_target
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner
    from tallow.schedules.cpu import int8_gemv

    from tiny_models import load_hf

    # int8: the AVX2 level (int8 decode, and int8 prefill through the column tiles' sign
    # trick), where this CPU can run it
    avx2 = int8_gemv.supported(resolve_target("cpu", "f32").tvm())
    levels = ["x86-64-v2"] if activations == "float" else (["x86-64-v3"] if avx2 else None)
    src = tiny_model_dir("qwen2_wide")
    path = write_gguf(src, tmp_path / "iq4.gguf", "qwen2", tensor_types=IQ_TYPES)
    art = compile_model(
        CompileOptions(model=str(path), output=tmp_path / "a", quiet=True, cpu=levels)
    )
    manifest = yaml.safe_load((art / "manifest.yaml").read_text())
    stored = {p["name"]: p["quant"] for p in manifest["params"]}
    assert stored["lm_head.weight"] == "iq4_xs"
    assert stored["model.embed_tokens.weight"] == "iq4_nl"
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert [stored[f"{qkv}.runs.{i}.weight"] for i in range(3)] == ["iq4_xs", "iq4_nl", "iq4_xs"]
    assert set(stored.values()) == {"iq4_nl", "iq4_xs", "none"}
    (library,) = manifest["libraries"]
    int8 = library["details"].get("decode_activations") == "int8_g32_row_step"
    int8_prefill = library["details"].get("prefill_activations") == "int8_g32_row_step"
    if activations == "int8" and not int8:
        assert not avx2
        pytest.skip("this CPU has no AVX2: decode keeps float activations")
    assert int8 == (activations == "int8") == int8_prefill

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


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["iq4_xs", "iq3_s", "iq3_xxs"])
def test_quant_iquant_on_a_float_model(tiny_model_dir, tmp_path, qtype):
    """`--quant iq4_xs:all` / `iq3_s:all` / `iq3_xxs:all` on safetensors (qwen2_wide: rows of
    256 and 512 weights): every matrix, the embedding and the head included, in that format,
    and the logits are transformers' on the weights as `gguf` decodes tallow's quantizer's
    blocks (float activations: x86-64-v2), to float32 rounding. (Rows that hold no whole
    super-block take iq4_nl: `test_iq4_xs_falls_back_to_iq4_nl`.)"""
    import torch
    import yaml
    from safetensors.numpy import load_file, save_file

    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    from tiny_models import load_hf

    src = tiny_model_dir("qwen2_wide")
    art = compile_model(
        CompileOptions(
            model=str(src),
            quant=f"{qtype}:all",
            output=tmp_path / "a",
            quiet=True,
            cpu=["x86-64-v2"],
        )
    )
    manifest = yaml.safe_load((art / "manifest.yaml").read_text())
    assert manifest["quantization"] == qtype
    stored = {p["name"]: p["quant"] for p in manifest["params"]}
    assert stored["lm_head.weight"] == stored["model.embed_tokens.weight"] == qtype
    assert {stored[n] for n in stored if n.endswith("proj.weight")} == {qtype}
    assert set(stored.values()) == {qtype, "none"}

    twin = tmp_path / "twin"
    twin.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (twin / f.name).write_bytes(f.read_bytes())
    weights = load_file(src / "model.safetensors")
    for name, w in weights.items():
        if w.ndim == 2:  # every matrix in `qtype` (asserted above through the manifest)
            blocks = quantize(w.astype(np.float32), qtype)
            blocks = blocks.reshape(-1, QUANT_FORMATS[qtype].type_size)
            weights[name] = _decoded_by_gguf(qtype, blocks).reshape(w.shape)
    save_file(weights, str(twin / "model.safetensors"))
    hf = load_hf(twin)
    runner = TVMModelRunner(art, kv=KVCacheConfig(4, 512, 64))
    for i in range(len(PROMPTS)):
        runner.add_sequence(i)
    got = runner.forward(list(enumerate(PROMPTS)))
    with torch.no_grad():
        want = np.stack([hf(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS])
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
