"""Tensor parallelism for mixture-of-experts models (each expert split by its width, the
router replicated, one all-reduce after the experts; docs/tensor-parallel.md): Qwen3-MoE at
TP=2 and TP=4, Qwen2-MoE's shared expert, q8_0 experts; and a TP=2 Qwen3-MoE artifact served
by `tallow serve` to 8 concurrent clients of the official openai package.

The oracle is the same model compiled at TP=1 (see test_tp_families.py)."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from server_helpers import start_subprocess
from test_tp_families import check_against_tp1, compiler

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory):
    return compiler(tiny_model_dir, tmp_path_factory)


@pytest.mark.parametrize(
    ("model", "degree", "quant", "tolerance"),
    [
        # 8 experts of width 48 (24, 12 per worker), top 2; layer 1 dense
        ("qwen3_moe_kv4", 2, None, 1e-4),
        ("qwen3_moe_kv4", 4, None, 1e-4),
        # the shared expert's partial sum joins the routed experts' before one all-reduce
        ("qwen2_moe", 2, None, 1e-4),
        # q8_0 experts (width 256: 128 inputs of the down stack per worker, 4 blocks); the
        # dense layers' int8 decode activations round per row (see test_tensor_parallel)
        ("qwen3_moe_wide", 2, "q8_0", 3e-2),
    ],
)
def test_moe_tp_matches_tp1(artifact, model, degree, quant, tolerance):
    one, tp = artifact(model, 1, quant), artifact(model, degree, quant)
    manifest = check_against_tp1(one, tp, degree, tolerance)
    # the expert stacks are split by each expert's width, not replicated
    shards = manifest.tensor_parallel.shards
    gate = shards["model.layers.0.mlp.experts.gate_proj"]
    assert gate["axis"] == 0 and len(gate["parts"]) == manifest.model.config["num_experts"]
    assert shards["model.layers.0.mlp.experts.down_proj"]["axis"] == 1
    assert "model.layers.0.mlp.gate.weight" not in shards  # the router is replicated


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
