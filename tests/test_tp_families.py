"""Tensor parallelism for the families `test_tensor_parallel.py` leaves out: mixture of experts
(Qwen3-MoE, Qwen2-MoE's shared expert, quantized experts), Gemma 3 and Mistral, at TP=2 and,
where the KV heads allow, TP=4; and a TP=2 artifact served to 8 concurrent clients.

The oracle is the same model compiled at TP=1: greedy tokens equal, logits over prefill,
decode, a batched prefill and a batched decode within float tolerance (`_compare`, in a
subprocess: Disco must be preloaded before tvm is imported, and this process compiles).
Artifacts are compiled once per module and shared by the tests."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from server_helpers import start_subprocess
from test_tensor_parallel import _compare, _compile

from tallow.runtime.manifest import Manifest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory):
    """artifact(model, degree, quant) -> a compiled folder (each compiled once per module)."""
    built = {}

    def get(model: str, degree: int, quant: str | None = None):
        key = (model, degree, quant)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{model}-{quant}-tp{degree}")
            built[key] = _compile(tiny_model_dir(model), out, degree, quant)
        return built[key]

    return get


@pytest.mark.parametrize(
    ("model", "degree", "quant", "tolerance"),
    [
        # 8 experts of width 48 (24, 12 per worker), top 2; layer 1 dense
        ("qwen3_moe_kv4", 2, None, 1e-4),
        ("qwen3_moe_kv4", 4, None, 1e-4),
        # the shared expert's partial sum joins the routed experts' before one all-reduce
        ("qwen2_moe", 2, None, 1e-4),
        # q8_0 experts (width 256: 128 inputs of the down stack per worker, 4 blocks); the
        # dense layers' int8 decode activations round per row, and a worker's row is half of
        # o_proj's input (see test_tensor_parallel), hence the looser bound
        ("qwen3_moe_wide", 2, "q8_0", 3e-2),
        # sliding and global layers with their own RoPE, q/k norms, sandwich norms
        ("gemma3", 2, None, 1e-4),
        # a window on every layer; 4 KV heads: 2 and 1 per worker
        ("mistral_kv4", 2, None, 1e-4),
        ("mistral_kv4", 4, None, 1e-4),
    ],
)
def test_tp_matches_tp1(artifact, model, degree, quant, tolerance):
    one, tp = artifact(model, 1, quant), artifact(model, degree, quant)
    manifest = Manifest.read(tp)
    assert manifest.tensor_parallel_degree == degree
    if "moe" in model:
        # the expert stacks are split by each expert's width, not replicated
        shards = manifest.tensor_parallel.shards
        gate = shards["model.layers.0.mlp.experts.gate_proj"]
        assert gate["axis"] == 0 and len(gate["parts"]) == manifest.model.config["num_experts"]
        assert shards["model.layers.0.mlp.experts.down_proj"]["axis"] == 1
        assert "model.layers.0.mlp.gate.weight" not in shards  # the router is replicated
    got = _compare(one, tp)
    print(f"{model} tp{degree} {quant}: tokens {got['tp']}, max logit difference {got['diff']:.3g}")
    assert got["tp"] == got["one"]
    assert got["diff"] <= tolerance * max(1.0, got["scale"]), got
    assert got["engine"]["tp"] == got["engine"]["one"]
    assert got["free"][0] == got["free"][1]
    assert all(f"compiled for {degree} tensor-parallel worker(s)" in e for e in got["refused"])


PROMPTS = [
    "The capital of France is",
    "def f(x):",
    "Numbers 0123",
    "The quick brown fox",
    "Héllo wörld",
    "東京は",
    "symbols !@#",
    "are tokens too",
]


def _answers(base_url: str, at_once: bool) -> list[str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=300)

    def ask(prompt: str) -> str:
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=8,
            temperature=0,
        )
        return reply.choices[0].message.content

    if not at_once:
        return [ask(p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, PROMPTS))


def test_tp2_server_answers_8_concurrent_clients_as_tp1_answers_each(artifact):
    """`tallow serve` on a TP=2 Qwen3-MoE artifact, 8 chat requests at once (batched on the
    workers); each answer must be the one the TP=1 artifact gives that prompt alone."""
    answers = {}
    for degree in (1, 2):
        server = start_subprocess(artifact("qwen3_moe_kv4", degree))
        try:
            answers[degree] = _answers(server.base_url, at_once=degree == 2)
        finally:
            server.proc.terminate()
            server.proc.wait(60)
    assert all(answers[1]), answers
    assert answers[2] == answers[1]
