"""`POST /v1/embeddings` over the fake runner, whose hidden states are predictable
(`reference_hidden`): exact vectors for every input shape, base64 and `dimensions`, the
official `openai` client, and the 400s.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from server_helpers import MODEL, serve_engine, tiny_tokenizer_bundle

from tallow.runtime.artifact import TokenizerBundle
from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server.app import ServerOptions

VOCAB = 320  # the tiny tokenizer's vocabulary


# -- the server over the fake runner -------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> TokenizerBundle:
    return tiny_tokenizer_bundle(tmp_path_factory.mktemp("tokenizer"), VOCAB)


def fake_server(bundle, **runner_kw):
    runner = FakeModelRunner(vocab_size=VOCAB, context_window=64, num_pages=256, **runner_kw)
    runner.tokenizer = bundle
    engine = Engine(
        runner,
        tokenizer=bundle.tokenizer,
        eos_token_ids=bundle.eos_token_ids,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=8
        ),
    )
    return serve_engine(engine, ServerOptions())


@pytest.fixture(scope="module")
def server(bundle):
    s = fake_server(bundle, hidden_size=24)
    yield s
    s.stop()


def expected(bundle, text: str | list[int], dims: int | None = None) -> np.ndarray:
    ids = text if isinstance(text, list) else bundle.tokenizer.encode(text).ids
    v = FakeModelRunner(vocab_size=VOCAB, hidden_size=24).reference_hidden(ids).mean(axis=0)
    v = v[:dims] if dims else v
    return v / np.linalg.norm(v)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=30)


def test_embeddings_input_shapes_and_usage(server, bundle):
    texts = ["The capital of France", "is Paris."]
    r = post(server, {"model": MODEL, "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL
    n_tokens = sum(len(bundle.tokenizer.encode(t).ids) for t in texts)
    assert body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    assert [d["index"] for d in body["data"]] == [0, 1]
    for d, t in zip(body["data"], texts, strict=True):
        assert d["object"] == "embedding"
        np.testing.assert_allclose(d["embedding"], expected(bundle, t), atol=1e-6)
    one = post(server, {"input": texts[0]}).json()["data"]
    assert len(one) == 1
    np.testing.assert_allclose(one[0]["embedding"], expected(bundle, texts[0]), atol=1e-6)
    ids = post(server, {"input": [5, 6, 7]}).json()["data"]
    np.testing.assert_allclose(ids[0]["embedding"], expected(bundle, [5, 6, 7]), atol=1e-6)
    many = post(server, {"input": [[5, 6, 7], [9]]}).json()["data"]
    np.testing.assert_allclose(many[1]["embedding"], expected(bundle, [9]), atol=1e-6)


def test_embeddings_base64_and_dimensions(server, bundle):
    body = {"model": MODEL, "input": ["hello world", "fox"]}
    floats = post(server, body).json()["data"]
    b64 = post(server, {**body, "encoding_format": "base64"}).json()["data"]
    for f, b in zip(floats, b64, strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(f["embedding"], dtype=np.float32))
    short = post(server, {**body, "dimensions": 8}).json()["data"]
    assert len(short[0]["embedding"]) == 8
    np.testing.assert_allclose(short[0]["embedding"], expected(bundle, "hello world", 8), atol=1e-6)
    assert abs(np.linalg.norm(short[1]["embedding"]) - 1) < 1e-5
    full = post(server, {**body, "dimensions": 24}).json()["data"]
    assert full[0]["embedding"] == floats[0]["embedding"]


def test_embeddings_openai_client(server, bundle):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    # The client asks for base64 by default and decodes it itself.
    res = client.embeddings.create(model=MODEL, input=["hello world", "fox"])
    assert [d.index for d in res.data] == [0, 1]
    np.testing.assert_allclose(res.data[0].embedding, expected(bundle, "hello world"), atol=1e-6)
    assert res.usage.prompt_tokens == res.usage.total_tokens > 0
    res = client.embeddings.create(model=MODEL, input="fox", encoding_format="float", dimensions=4)
    np.testing.assert_allclose(res.data[0].embedding, expected(bundle, "fox", 4), atol=1e-6)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="")


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": []}, "input", None),
        ({"input": ""}, "input", "invalid_value"),
        ({"input": ["a", ""]}, "input", "invalid_value"),
        ({"input": [[]]}, "input", None),
        ({"input": [[1, 2], []]}, "input", None),
        ({"input": [1, "a"]}, "input", None),
        ({"input": 5}, "input", None),
        ({"input": None}, "input", None),
        ({}, "input", "missing_parameter"),
        ({"input": [-1]}, "input", None),
        ({"input": [VOCAB]}, "input", "invalid_token_id"),
        ({"input": [[3], [VOCAB + 5]]}, "input", "invalid_token_id"),
        ({"input": list(range(3, 70))}, "input", "context_length_exceeded"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
        ({"input": "x", "dimensions": 0}, "dimensions", None),
        ({"input": "x", "dimensions": 25}, "dimensions", "invalid_value"),
        ({"input": "x", "dimensions": "8"}, "dimensions", "invalid_type"),
    ],
)
def test_embeddings_bad_input_is_400(server, bundle, body, param, code):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    if code:
        assert err["code"] == code, err
    ok = post(server, {"input": "fox"})
    assert ok.status_code == 200
    np.testing.assert_allclose(
        ok.json()["data"][0]["embedding"], expected(bundle, "fox"), atol=1e-6
    )


def test_embeddings_wrong_model_and_no_hidden_function(server, bundle):
    r = post(server, {"model": "other", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    old = fake_server(bundle, embedding_pooling=None)
    try:
        r = post(old, {"input": "x"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert (
            err["code"] == "embeddings_not_supported" and "hidden-state function" in err["message"]
        )
    finally:
        old.stop()
