"""The decode roofline (`runtime/roofline.py`, `tallow inspect --gpu`) against arithmetic done
here by hand from the tiny Qwen3's config (tests/tiny_models.py), not from the manifest."""

from __future__ import annotations

import pytest

from tallow.runtime.errors import ArtifactError
from tallow.runtime.manifest import Manifest
from tallow.runtime.roofline import GPUS, decode_roofline, gpu_spec


def _hand_figures(batch: int, context: int):
    # tiny "qwen3": hidden 64, ffn 128, 2 layers, 4 heads / 1 KV head, head_dim 32, vocab 320,
    # untied head, float32 weights and KV cache.
    h, f, layers, q, kvh, d, vocab = 64, 128, 2, 4, 1, 32, 320
    per_layer = (
        h * q * d  # q_proj
        + 2 * h * kvh * d  # k_proj, v_proj
        + q * d * h  # o_proj
        + 3 * h * f  # gate, up, down
        + 2 * h  # input / post-attention norms
        + 2 * d  # q_norm, k_norm
    )
    weights = 4 * (layers * per_layer + h + vocab * h)  # + final norm + lm_head
    embedding_rows = 4 * batch * h  # only the looked-up rows of the (untied) table
    kv = batch * context * layers * 2 * kvh * d * 4
    step = weights + embedding_rows + kv
    return weights, embedding_rows, kv, batch * 4.8e12 / step  # H200: 4.8 TB/s


def test_decode_roofline_tiny_qwen3(tiny_artifact):
    manifest = Manifest.read(tiny_artifact("qwen3"))
    weights, rows, kv, bound = _hand_figures(batch=2, context=100)
    r = decode_roofline(manifest, "H200", batch=2, context=100)
    assert (r.weight_bytes, r.embedding_bytes, r.kv_bytes) == (weights, rows, kv)
    assert r.tokens_per_second == pytest.approx(bound, rel=1e-12)
    # more context: only the KV term grows
    r2 = decode_roofline(manifest, "h200", batch=2, context=200)
    assert r2.kv_bytes == 2 * kv and r2.weight_bytes == weights


def test_inspect_gpu_prints_the_bound(tiny_artifact, capsys):
    from tallow.cli.main import main

    folder = tiny_artifact("qwen3")
    assert main(["inspect", str(folder), "--gpu", "A100 80GB", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    weights, rows, kv, _ = _hand_figures(batch=4, context=512)
    bound = 4 * 2039e9 / (weights + rows + kv)
    assert f"upper bound: {bound:,.1f} tok/s" in out
    assert "A100 80GB (2039 GB/s" in out


def test_unknown_gpu_is_named(tiny_artifact, capsys):
    from tallow.cli.main import main

    assert main(["inspect", str(tiny_artifact("qwen3")), "--gpu", "B300"]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU 'B300'" in err and "H200" in err
    with pytest.raises(ArtifactError, match="batch must be >= 1"):
        decode_roofline(Manifest.read(tiny_artifact("qwen3")), "L4", batch=0)


def test_every_gpu_has_a_cited_source():
    assert set(GPUS) == {"H200", "H100 SXM", "A100 80GB", "L4", "RTX 4090", "M2 Max", "M3 Max"}
    assert all(g.source and g.bandwidth_gbs > 0 and g.f16_tflops > 0 for g in GPUS.values())


@pytest.mark.parametrize(
    "asked, meant",
    [
        ("H100", "H100 SXM"),  # issue 35: was refused, it wanted "H100 SXM"
        ("h100-sxm", "H100 SXM"),
        ("NVIDIA H100 SXM", "H100 SXM"),
        ("a100", "A100 80GB"),
        ("A100-80G", "A100 80GB"),
        ("4090", "RTX 4090"),
        ("rtx4090", "RTX 4090"),
        ("m3 max", "M3 Max"),
        ("H200", "H200"),
    ],
)
def test_gpu_names_are_matched_loosely(asked, meant):
    assert gpu_spec(asked).name == meant


def test_a_loose_name_with_two_candidates_or_none_is_refused():
    with pytest.raises(ArtifactError, match="could be M2 Max or M3 Max"):
        gpu_spec("Max")
    with pytest.raises(ArtifactError, match="unknown GPU 'B200'"):
        gpu_spec("B200")  # shares "200" with the H200, but not its letters


def test_inspect_gpu_on_a_cpu_only_artifact_says_so(tiny_artifact, capsys):
    from tallow.cli.main import main

    assert main(["inspect", str(tiny_artifact("qwen3")), "--gpu", "H100"]) == 0
    out, err = capsys.readouterr()
    assert "decode roofline on H100 SXM" in out
    assert err.startswith("note: this artifact has no GPU library (it has: cpu native")
