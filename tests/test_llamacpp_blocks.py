"""Q1_0 and NVFP4 (compiler/quant/lowbit) against llama.cpp's own codecs; tallow's IQ3_S
quantizer against llama.cpp's on the same weights.

The `gguf` package decodes NVFP4 but has no quantizer for it, and knows Q1_0's size but
neither decodes nor encodes it. The oracle is `tests/data/llamacpp_blocks.npz`, written by
llama.cpp's GGML library itself (`to_float` and `from_float_ref` of its type traits, through
`tests/fixtures/regen_llamacpp_blocks.py`): arbitrary blocks and what llama.cpp decodes from
them, float rows and the blocks llama.cpp writes for them. MXFP4, which `gguf` decodes, is
in the file too, as a check that the fixture's method agrees with the package.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from quant_blocks import tir_dequantize

from tallow.compiler.quant import QUANT_FORMATS, dequantize, quantize

FIXTURE = np.load(Path(__file__).parent / "data" / "llamacpp_blocks.npz")
NEW = ["q1_0", "nvfp4"]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", [*NEW, "mxfp4"])
def test_decoder_is_llama_cpp_bit_for_bit(qtype):
    blocks, ref = FIXTURE[f"{qtype}_blocks"], FIXTURE[f"{qtype}_decoded"]
    ours = dequantize(blocks, qtype, ref.shape)
    np.testing.assert_array_equal(_bits(ours), _bits(ref))


@pytest.mark.parametrize("qtype", [*NEW, "mxfp4"])
def test_the_tests_oracle_is_llama_cpp(qtype):
    """`gguf.quants.dequantize` (with tests/ggml_extra_types.py's Q1_0), the oracle the kernel
    tests compare against, decodes as llama.cpp does."""
    blocks, ref = FIXTURE[f"{qtype}_blocks"], FIXTURE[f"{qtype}_decoded"]
    with np.errstate(over="ignore"):  # MXFP4's largest exponents overflow to inf, as in C
        got = gguf.quants.dequantize(blocks, QUANT_FORMATS[qtype].ggml_type)
    got = got.reshape(ref.shape)
    np.testing.assert_array_equal(_bits(got), _bits(ref))


@pytest.mark.parametrize("qtype", NEW)
def test_quantizer_is_llama_cpp_byte_for_byte(qtype):
    """Gaussian rows at LLM scale and at scale 1, an all-zero block, scattered zeros: tallow
    writes the blocks llama.cpp's reference quantizer writes (what `llama-quantize` uses)."""
    x, ref = FIXTURE[f"{qtype}_x"], FIXTURE[f"{qtype}_encoded"]
    np.testing.assert_array_equal(quantize(x, qtype), ref)


@pytest.mark.parametrize("qtype", NEW)
def test_tir_decoder_is_llama_cpp_bit_for_bit(qtype):
    """The TE dequantization every fused dequantize-matmul is built from."""
    blocks, ref = FIXTURE[f"{qtype}_blocks"], FIXTURE[f"{qtype}_decoded"]
    np.testing.assert_array_equal(_bits(tir_dequantize(blocks, qtype)), _bits(ref))


def test_fixture_reaches_every_scale():
    """The NVFP4 blocks hold every UE4M3 scale byte (E4M3's NaN 0x7F and the subnormals
    included); Q1_0's scales are finite f16 of both signs."""
    assert set(FIXTURE["nvfp4_blocks"][:, 0]) == set(range(256))
    d = FIXTURE["q1_0_blocks"][:, :2].copy().view(np.float16)
    assert np.isfinite(d).all() and (d > 0).any() and (d < 0).any()


def test_signed_binary_weights_round_trip():
    """What Q1_0 is for (1-bit models): a block of +-s with mean magnitude s stores exactly."""
    rng = np.random.default_rng(0)
    s = rng.uniform(0.01, 0.1, (16, 1)).astype(np.float16).astype(np.float32)
    w = (rng.choice([-1.0, 1.0], (16, 256)) * s).astype(np.float32)
    np.testing.assert_array_equal(dequantize(quantize(w, "q1_0"), "q1_0", w.shape), w)


def test_a_type_the_gguf_reader_does_not_know_is_refused_in_one_line(tmp_path):
    """llama.cpp writes Q2_0 (GGML type 42), which the pinned `gguf` reader cannot parse: the
    compile's source check names the type and what to do, instead of "corrupt file"."""
    from tallow.compiler.gguf_source import check_gguf_file
    from tallow.runtime.errors import ModelSourceError

    path = tmp_path / "q2_0.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, 34), np.uint8), raw_dtype=8)  # Q8_0
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # after n_dims (u32) and 2 dims (u64)
    assert int.from_bytes(data[at : at + 4], "little") == 8
    data[at : at + 4] = (42).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelSourceError, match="GGML type 42 \\(Q2_0\\)") as err:
        check_gguf_file(path)
    assert "\n" not in str(err.value) and "requantize" in str(err.value)


@pytest.mark.parametrize("qtype", ["iq3_s", "iq3_xxs"])
def test_lattice_quantizer_at_least_as_close_as_llama_cpps(qtype):
    """tallow's own IQ3_S and IQ3_XXS quantizers against llama.cpp's (`ggml_quantize_chunk`, no
    importance matrix, as `llama-quantize` writes those types without `--imatrix`) on the same
    rows: Gaussian at scale 1 and at 0.02, and heavy-tailed (cubed). Each third's relative RMS
    error, both decoded by `gguf`: tallow's at most llama.cpp's (measured IQ3_S 15.4 / 15.4 /
    24.5% against 16.8 / 16.7 / 32.3%, IQ3_XXS 20.9 / 20.8 / 28.6% against 21.4 / 21.3 /
    40.4%)."""
    x, ref = FIXTURE["iq3_s_x"], FIXTURE[f"{qtype}_encoded"]
    ggml_type = QUANT_FORMATS[qtype].ggml_type
    theirs = gguf.quants.dequantize(ref, ggml_type).reshape(x.shape)
    ours = gguf.quants.dequantize(quantize(x, qtype), ggml_type).reshape(x.shape)
    third = len(x) // 3
    for part in (slice(0, third), slice(third, 2 * third), slice(2 * third, None)):
        power = np.mean(x[part].astype(np.float64) ** 2)
        err_ours = np.sqrt(np.mean((ours[part] - x[part]) ** 2) / power)
        err_theirs = np.sqrt(np.mean((theirs[part] - x[part]) ** 2) / power)
        assert err_ours <= err_theirs, (part, err_ours, err_theirs)
