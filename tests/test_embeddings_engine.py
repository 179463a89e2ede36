"""Embeddings (issue 26): the hidden-state function, host pooling across prefill chunks, the
engine's embedding requests next to generation (`POST /v1/embeddings` is in
test_embeddings_server.py).

The fake runner's hidden states are predictable (`reference_hidden`), so the engine tests
check exact vectors in milliseconds; the compiled tiny models are checked against
transformers' last hidden state (after the final norm), pooled and L2-normalised the same way.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_helpers import MODEL

from tallow.runtime.engine import Engine, GenerationNotSupportedError
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.request import ContextLengthExceededError
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server.app import ServerOptions

from tiny_models import load_hf, make_model

V = 101


def pooled(rows: np.ndarray, pooling: str) -> np.ndarray:
    v = rows.astype(np.float64).mean(axis=0) if pooling == "mean" else rows[-1].astype(np.float64)
    return (v / np.linalg.norm(v)).astype(np.float32)


def fake_engine(pooling="mean", chunk=4, num_pages=64, generation=True, **kw) -> Engine:
    runner = FakeModelRunner(
        page_size=4,
        num_pages=num_pages,
        vocab_size=V,
        context_window=128,
        embedding_pooling=pooling,
        generation=generation,
        **kw,
    )
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=16,
        prefill_chunk_size=chunk,
        prefix_cache_max_tokens=64,
    )
    return Engine(runner, scheduler_config=config)


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + 7 * i) % (V - 1) + 1 for i in range(n)]


# -- the engine over the fake runner -------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_engine_pools_across_chunks(pooling):
    engine = fake_engine(pooling)
    ref = FakeModelRunner(vocab_size=V)
    prompts = [prompt(1), prompt(3, 5), prompt(4, 9), prompt(23, 2), prompt(40, 3)]
    vectors = engine.embed_sync(prompts)
    for p, v in zip(prompts, vectors, strict=True):
        assert v.dtype == np.float32 and v.shape == (16,)
        np.testing.assert_allclose(v, pooled(ref.reference_hidden(p), pooling), atol=1e-6)
    # The long prompts were prefilled in chunks of 4, several embeddings per forward.
    assert max(len(items) for items in engine.runner.hidden_log) > 1
    assert max(len(t) for items in engine.runner.hidden_log for _, t in items) == 4
    # Every page came back: nothing was kept as a prefix-cache entry.
    assert engine.runner.sequence_ids() == []
    assert engine.runner.num_free_pages() == engine.runner.num_pages


def test_engine_embed_async_and_identical_prompts_never_share_kv():
    engine = fake_engine("mean", chunk=16)
    ref = FakeModelRunner(vocab_size=V)

    async def run():
        a = engine.embed([prompt(9), prompt(9)])
        b = engine.embed([prompt(9)])
        out = await asyncio.gather(a, b)
        await engine.shutdown()
        return out

    (x, y), (z,) = asyncio.run(run())
    want = pooled(ref.reference_hidden(prompt(9)), "mean")
    for v in (x, y, z):
        np.testing.assert_allclose(v, want, atol=1e-6)
    assert engine.stats().prefix_cache_hit_tokens == 0


def test_embeddings_interleave_with_generation_without_changing_it():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    gen_prompts = [prompt(10, 1), prompt(21, 4), prompt(6, 8)]
    alone = fake_engine("mean", chunk=8).generate(gen_prompts, params)
    expected = [[t for o in outs for d in o.outputs for t in d.token_ids] for outs in alone]

    engine = fake_engine("last", chunk=8)
    ref = FakeModelRunner(vocab_size=V)
    results: list[list] = [[] for _ in gen_prompts]
    for p, sink in zip(gen_prompts, results, strict=True):
        engine.submit(p, params, sink.append)
    emb_prompts = [prompt(30, 2), prompt(5, 3), prompt(17, 6)]
    emb_out: list[list] = [[] for _ in emb_prompts]
    both = 0
    steps = 0
    while engine._has_work():
        if steps == 2:  # arrive while the generations are under way
            for p, sink in zip(emb_prompts, emb_out, strict=True):
                engine.submit_embedding(p, sink.append)
        f, h = len(engine.runner.forward_log), len(engine.runner.hidden_log)
        engine.run_step()
        steps += 1
        both += len(engine.runner.forward_log) > f and len(engine.runner.hidden_log) > h
    assert both >= 1, "no step carried both generation and embedding tokens"
    got = [[t for o in outs for d in o.outputs for t in d.token_ids] for outs in results]
    assert got == expected
    for p, outs in zip(emb_prompts, emb_out, strict=True):
        (out,) = outs
        assert out.prompt_tokens == len(p)
        np.testing.assert_allclose(
            out.embedding, pooled(ref.reference_hidden(p), "last"), atol=1e-6
        )


def test_preempted_embedding_restarts_its_pooling():
    # 6 pages of 4 tokens: a long generation forces the newer embedding out mid-prefill.
    engine = fake_engine("mean", chunk=4, num_pages=8)
    ref = FakeModelRunner(vocab_size=V)
    gen = [[] for _ in range(1)]
    engine.submit(
        prompt(4), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), gen[0].append
    )
    emb: list = []
    engine.submit_embedding(prompt(14, 3), emb.append)
    while engine._has_work():
        engine.run_step()
    assert gen[0][-1].finished
    np.testing.assert_allclose(
        emb[0].embedding, pooled(ref.reference_hidden(prompt(14, 3)), "mean"), atol=1e-6
    )


def test_engine_rejections():
    engine = fake_engine("mean")
    with pytest.raises(ValueError, match="at least one token"):
        engine.embed_sync([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.embed_sync([[V]])
    with pytest.raises(ContextLengthExceededError):
        engine.embed_sync([prompt(129)])
    assert engine.embed_sync([prompt(3)])[0].shape == (16,)
    embed_only = fake_engine("last", generation=False)
    with pytest.raises(GenerationNotSupportedError, match="embeddings only"):
        embed_only.generate([prompt(3)], SamplingParams(max_tokens=2))
    assert embed_only.embed_sync([prompt(3)])[0].shape == (16,)
    old = fake_engine(None)
    with pytest.raises(ValueError, match="no hidden-state function"):
        old.embed_sync([prompt(3)])


# -- compiled tiny models against transformers ---------------------------------------------------


def hf_embeddings(folder: Path, prompts: list[list[int]], pooling: str) -> list[np.ndarray]:
    import torch

    model = load_hf(folder)
    out = []
    with torch.no_grad():
        for p in prompts:
            rows = model.model(torch.tensor([p])).last_hidden_state[0].numpy()
            out.append(pooled(rows, pooling))
    return out


def real_engine(artifact: Path):
    from tallow.runtime.engine_factory import EngineOptions, build_engine

    # A prefill chunk of 16 tokens: the 40-token prompt is pooled across three chunks.
    options = EngineOptions(max_num_seqs=4, prefill_chunk_size=16, kv_cache_mem_mb=4)
    return build_engine(artifact, options)


REAL_PROMPTS = [[5, 6, 7], list(range(3, 43)), [100, 200, 17, 4, 4, 9, 250], [42]]


def test_generate_artifact_embeds_like_transformers_mean(tiny_artifact, tiny_model_dir):
    from tallow.runtime.manifest import Manifest

    art = tiny_artifact("llama")
    manifest = Manifest.read(art)
    assert manifest.task == "generate" and "batch_prefill_hidden" in manifest.functions
    assert manifest.embedding.pooling == "mean" and manifest.embedding.dimensions == 64
    engine = real_engine(art)
    got = engine.embed_sync(REAL_PROMPTS)  # batched
    want = hf_embeddings(tiny_model_dir("llama"), REAL_PROMPTS, "mean")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)
    one = [engine.embed_sync([p])[0] for p in REAL_PROMPTS]  # batch 1
    for g, w in zip(one, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)


def test_generate_artifact_interleaved_generation_unchanged(tiny_artifact, tiny_model_dir):
    engine = real_engine(tiny_artifact("llama"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    gen_prompts = [[5, 6, 7, 8], list(range(10, 30))]
    alone = engine.generate(gen_prompts, params)
    want_tokens = [[t for o in outs for d in o.outputs for t in d.token_ids] for outs in alone]
    results: list[list] = [[] for _ in gen_prompts]
    for p, sink in zip(gen_prompts, results, strict=True):
        engine.submit(p, params, sink.append)
    emb: list[list] = [[] for _ in REAL_PROMPTS]
    for p, sink in zip(REAL_PROMPTS, emb, strict=True):
        engine.submit_embedding(p, sink.append)
    while engine._has_work():
        engine.run_step()
    got = [[t for o in outs for d in o.outputs for t in d.token_ids] for outs in results]
    assert got == want_tokens
    want = hf_embeddings(tiny_model_dir("llama"), REAL_PROMPTS, "mean")
    for outs, w in zip(emb, want, strict=True):
        np.testing.assert_allclose(outs[0].embedding, w, atol=1e-4)


@pytest.fixture(scope="module")
def embed_artifact(tmp_path_factory):
    """Qwen3 (untied head) as a sentence-transformers-style last-token model, --task embed."""
    from tallow.compiler.pipeline import CompileOptions, compile_model

    src = make_model(tmp_path_factory.mktemp("qwen3-emb-src") / "qwen3-emb", "qwen3")
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True})
    )
    out = tmp_path_factory.mktemp("qwen3-emb-art")
    art = compile_model(CompileOptions(model=str(src), output=out, quiet=True, task="embed"))
    return src, art


def test_embed_task_artifact(embed_artifact):
    from tallow.runtime.manifest import Manifest

    src, art = embed_artifact
    assert art.name.endswith("-embed")
    manifest = Manifest.read(art)
    assert manifest.task == "embed"
    assert manifest.functions == ["embed", "batch_prefill_hidden", "create_paged_kv_cache"]
    assert manifest.embedding.pooling == "last"
    assert manifest.embedding.pooling_source == "1_Pooling/config.json"
    assert not any(p.name.startswith("lm_head") for p in manifest.params)
    engine = real_engine(art)
    assert not engine.supports_generation
    got = engine.embed_sync(REAL_PROMPTS)
    for g, w in zip(got, hf_embeddings(src, REAL_PROMPTS, "last"), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)


def test_embed_task_artifact_served(embed_artifact):
    openai = pytest.importorskip("openai")
    src, art = embed_artifact
    from server_helpers import start_server

    server = start_server(
        art, ServerOptions(), max_num_seqs=4, prefill_chunk_size=16, kv_cache_mem_mb=4
    )
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        long_ids = list(range(3, 43))
        res = client.embeddings.create(model=MODEL, input=[[5, 6, 7], long_ids])
        want = hf_embeddings(src, [[5, 6, 7], long_ids], "last")
        for d, w in zip(res.data, want, strict=True):
            np.testing.assert_allclose(d.embedding, w, atol=1e-4)
        res = client.embeddings.create(model=MODEL, input=[5, 6, 7], encoding_format="float")
        np.testing.assert_allclose(res.data[0].embedding, want[0], atol=1e-4)
        with pytest.raises(openai.BadRequestError, match="embeddings only"):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        r = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        )
        assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]
        assert client.embeddings.create(model=MODEL, input="ok").data[0].index == 0
    finally:
        server.stop()


# -- pooling from the source ---------------------------------------------------------------------


def test_choose_pooling(tmp_path):
    from tallow.compiler.pooling import choose_pooling
    from tallow.runtime.errors import ModelSourceError

    assert choose_pooling(tmp_path, "smollm2", None) == ("mean", "default")
    assert choose_pooling(tmp_path, "qwen3-embedding-0.6b", None) == ("last", "model name")
    assert choose_pooling(tmp_path, "qwen3-embedding-0.6b", "mean") == ("mean", "--pooling")
    (tmp_path / "1_Pooling").mkdir()
    cfg = tmp_path / "1_Pooling" / "config.json"
    cfg.write_text(json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    assert choose_pooling(tmp_path, "x-embedding", None) == ("mean", "1_Pooling/config.json")
    cfg.write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert choose_pooling(tmp_path, "x", None) == ("last", "1_Pooling/config.json")
    cfg.write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ModelSourceError, match="pooling_mode_cls_token is not supported"):
        choose_pooling(tmp_path, "x", None)
    with pytest.raises(ModelSourceError, match="--pooling 'max'"):
        choose_pooling(tmp_path, "x", "max")
