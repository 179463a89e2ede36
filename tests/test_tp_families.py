"""Tensor parallelism for the dense families `test_tensor_parallel.py` leaves out (Gemma 3,
Mistral, at TP=2 and, where the KV heads allow, TP=4) and for a llama.cpp-style K-quant mix
(q4k: Q4_K_M's rules, so a fused q/k/v of two formats is split run by run).

The oracle is the same model compiled at TP=1: greedy tokens equal, logits over prefill,
decode, a batched prefill and a batched decode within float tolerance (`_compare`, in a
subprocess: Disco must be preloaded before tvm is imported, and this process compiles).
Artifacts are compiled once per module and shared by the tests."""

from __future__ import annotations

import pytest
from test_tensor_parallel import _compare, _compile

from tallow.runtime.manifest import Manifest

pytestmark = pytest.mark.slow


def compiler(tiny_model_dir, tmp_path_factory):
    """compile(model, degree, quant) -> a compiled folder, each compiled once."""
    built = {}

    def get(model: str, degree: int, quant: str | None = None):
        key = (model, degree, quant)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{model}-{quant}-tp{degree}")
            built[key] = _compile(tiny_model_dir(model), out, degree, quant)
        return built[key]

    return get


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory):
    return compiler(tiny_model_dir, tmp_path_factory)


@pytest.mark.parametrize(
    ("model", "degree", "quant", "tolerance"),
    [
        # sliding and global layers with their own RoPE, q/k norms, sandwich norms
        ("gemma3", 2, None, 1e-4),
        # a window on every layer; 4 KV heads: 2 and 1 per worker
        ("mistral_kv4", 2, None, 1e-4),
        ("mistral_kv4", 4, None, 1e-4),
        # q4k/q6k blocks of 256 (o_proj: 256 of 512 inputs per worker), layer 1's q/k/v in two
        # formats (two runs); the int8 decode activations round per row (see
        # test_tensor_parallel's q8_0), hence the looser bound
        ("qwen3_heads8", 2, "q4k", 3e-2),
    ],
)
def test_tp_matches_tp1(artifact, model, degree, quant, tolerance):
    check_against_tp1(artifact(model, 1, quant), artifact(model, degree, quant), degree, tolerance)


def check_against_tp1(one, tp, degree: int, tolerance: float) -> Manifest:
    """The TP artifact `tp` against `one` (TP=1): the same greedy tokens, through the runner
    and the engine; logits within `tolerance` (relative to their largest); the same free KV
    pages; a wrong worker count refused. Returns `tp`'s manifest."""
    manifest = Manifest.read(tp)
    assert manifest.tensor_parallel_degree == degree
    got = _compare(one, tp)
    print(f"{tp.name}: tokens {got['tp']}, max logit difference {got['diff']:.3g}")
    assert got["tp"] == got["one"]
    assert got["diff"] <= tolerance * max(1.0, got["scale"]), got
    assert got["engine"]["tp"] == got["engine"]["one"]
    assert got["free"][0] == got["free"][1]
    assert len(got["refused"]) == 2
    assert all(f"compiled for {degree} tensor-parallel worker(s)" in e for e in got["refused"])
    return manifest
