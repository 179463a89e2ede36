"""lm-evaluation-harness itself (PyPI `lm-eval`, its `local-completions` model) against a live
server of the embedded SmolLM2, on two small local tasks (tests/data/lm_eval): a
loglikelihood multiple choice (5 questions x 4 choices, scored through /v1/completions with
`echo`, `logprobs` and `max_tokens` 1) and a generate_until (3 questions). Fully offline:
lm_eval runs in a child process with the Hugging Face hub and datasets offline, its
tokenizer the artifact's own tokenizer files, its dataset the local jsonl.

The oracle: the same compiled model's logits at every position (`all_position_logits`, no
engine, scheduler, sampler or server), numpy log-softmax in float64. Each (context,
continuation) lm_eval scored, tokenized as lm_eval does, must get the oracle's loglikelihood
within 1e-4 and the same is-greedy flag; each document's accuracy must be the oracle's argmax
against the gold answer; each generated answer must be the oracle's greedy continuation cut
where lm_eval's stop strings cut it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

TASKS = Path(__file__).parent / "data" / "lm_eval"

# Run in a child so the offline switches hold from the first import of huggingface_hub /
# datasets (the test process may have imported them already, online).
RUN_LM_EVAL = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager

base_url, tokenizer, out = sys.argv[1:4]
results = lm_eval.simple_evaluate(
    model="local-completions",
    model_args={
        "model": "tiny",
        "base_url": base_url,
        "tokenizer_backend": "huggingface",
        "tokenizer": tokenizer,
        "num_concurrent": 1,
        "batch_size": 8,  # several prompts per request: the engine batches them
        "max_retries": 1,
        "timeout": 120,
    },
    tasks=["tallow_facts_mc", "tallow_facts_gen"],
    task_manager=TaskManager(include_path=".", include_defaults=False),
    log_samples=True,
    apply_chat_template=False,
)
keep = {"results": results["results"], "samples": results["samples"]}
with open(out, "w") as f:
    json.dump(keep, f, default=str)
"""


@pytest.fixture(scope="module")
def lm_eval_run(smollm2_artifact, tmp_path_factory):
    pytest.importorskip("lm_eval")
    from server_helpers import start_server

    from tallow.server.app import ServerOptions

    tmp = tmp_path_factory.mktemp("lm_eval")
    # deterministic: a request's logits are then its own whatever lm_eval batches beside it
    # (on a CPU with AMX, prefill's matmuls take bf16 tiles for calls of 32 rows or more,
    # so in normal mode a prompt batched with others gets other bits than alone: up to
    # 0.02 in a log-likelihood here); the oracle runs each text alone
    server = start_server(
        smollm2_artifact, ServerOptions(), max_num_seqs=4, kv_cache_mem_mb=64, deterministic=True
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf"),  # nothing cached from elsewhere, nothing left behind
        "OPENAI_API_KEY": "",
    }
    out = tmp / "results.json"
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                RUN_LM_EVAL,
                f"{server.base_url}/v1/completions",
                str(smollm2_artifact),
                str(out),
            ],
            cwd=TASKS,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"lm_eval ran in {time.monotonic() - t0:.1f}s")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def oracle(smollm2_artifact):
    """Logits after every token of `ids`, from the compiled model alone."""
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner, all_position_logits

    runner = TVMModelRunner(smollm2_artifact, kv=KVCacheConfig(1, 1024, 256))
    return runner, lambda ids: all_position_logits(runner, ids).astype(np.float64)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_artifact):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(smollm2_artifact))


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm_eval's split: trailing spaces of the context move to the continuation; the
    continuation's ids are the whole text's ids after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


def test_loglikelihoods_match_the_models_logits(lm_eval_run, oracle, hf_tokenizer):
    _, logits_of = oracle
    samples = lm_eval_run["samples"]["tallow_facts_mc"]
    assert len(samples) == 5
    correct = []
    for doc in samples:
        ours = []
        for (context, continuation), (ll, greedy) in zip(
            doc["arguments"], doc["filtered_resps"], strict=True
        ):
            ctx, cont = encode_pair(hf_tokenizer, context, continuation)
            ids = ctx + cont
            lp = log_softmax(logits_of(ids))
            rows = lp[len(ctx) - 1 : len(ids) - 1]
            expect = float(sum(rows[i, t] for i, t in enumerate(cont)))
            assert ll == pytest.approx(expect, abs=1e-4), (context, continuation)
            assert bool(greedy) == all(rows[i].argmax() == t for i, t in enumerate(cont))
            ours.append(expect)
        gold = int(doc["target"])
        assert doc["acc"] == float(int(np.argmax(ours)) == gold)
        correct.append(int(np.argmax(ours)) == gold)
    acc = lm_eval_run["results"]["tallow_facts_mc"]["acc,none"]
    assert acc == pytest.approx(np.mean(correct))


def test_generations_are_the_greedy_continuations(lm_eval_run, oracle, hf_tokenizer):
    runner, logits_of = oracle
    eos = set(runner.tokenizer.eos_token_ids)
    samples = lm_eval_run["samples"]["tallow_facts_gen"]
    assert len(samples) == 3
    matches = []
    for doc in samples:
        context, kwargs = doc["arguments"][0]
        until = kwargs["until"]
        ids = hf_tokenizer(context, add_special_tokens=False).input_ids
        out: list[int] = []
        text = ""
        for _ in range(kwargs["max_gen_toks"]):
            token = int(np.argmax(logits_of(ids + out)[-1]))
            if token in eos:
                break
            out.append(token)
            text = hf_tokenizer.decode(out)
            if any(s in text for s in until):
                break
        for s in until:
            text = text.split(s)[0]
        got = doc["filtered_resps"][0]
        assert got == text, (context, got, text)
        matches.append(text.strip().lower() == doc["target"].strip().lower())
    em = lm_eval_run["results"]["tallow_facts_gen"]["exact_match,none"]
    assert em == pytest.approx(np.mean(matches))
