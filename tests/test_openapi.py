"""The OpenAPI document (`/openapi.json`, server/openapi.py) tells the truth about request
bodies and error responses, checked against independent judges: `jsonschema` validates
OpenAI-shaped bodies against the document, pydantic (the server's own parser) accepts what
Schemathesis draws from the document, and Schemathesis' conformance checks judge the live
server's error answers (fake runner: milliseconds per request)."""

from __future__ import annotations

import warnings

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_helpers import MODEL, serve_engine, tiny_tokenizer_bundle  # noqa: I001
from test_server_routes import ROUTES

from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server import protocol, protocol_chat, protocol_responses
from tallow.server.app import ServerOptions

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
MODELS = {
    "/v1/chat/completions": protocol_chat.ChatCompletionRequest,
    "/v1/completions": protocol.CompletionRequest,
    "/v1/responses": protocol_responses.ResponseCreateRequest,
    "/v1/embeddings": protocol.EmbeddingRequest,
    "/tokenize": protocol.TokenizeRequest,
    "/detokenize": protocol.DetokenizeRequest,
}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
# What OpenAI's documentation and the official client send (extras are ignored by the server).
VALID = {
    "/v1/chat/completions": [
        {
            "model": MODEL,
            "messages": CHAT,
            "temperature": 0.2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "stop": ["\n"],
            "seed": -5,
            "logit_bias": {"5": -100},
            "metadata": {"a": "b"},
        },
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "x"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "1"},
            ],
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}},
        },
    ],
    "/v1/completions": [
        {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 2, "max_tokens": 0},
        {"model": MODEL, "prompt": [[1, 2], [3]], "n": 2, "guided_choice": ["a", "b"]},
    ],
    "/v1/responses": [
        {"model": MODEL, "input": "x", "instructions": "y", "max_output_tokens": 5},
        {
            "model": MODEL,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "x"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "1"},
            ],
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
        },
    ],
    "/v1/embeddings": [
        {"model": MODEL, "input": ["a", "b"], "encoding_format": "base64"},
        {"input": [[1, 2]], "dimensions": 8},
    ],
    "/tokenize": [{"prompt": "x"}, {"messages": CHAT, "add_special_tokens": False}],
    "/detokenize": [{"tokens": [1, 2]}],
}
INVALID = {
    "/v1/chat/completions": [
        {"model": MODEL},
        {"model": MODEL, "messages": CHAT, "temperature": 3},
        {"model": MODEL, "messages": CHAT, "n": "2"},
    ],
    "/v1/completions": [{"model": MODEL, "prompt": "x", "logprobs": 21}, {"prompt": "x"}],
    "/v1/responses": [{"model": MODEL, "input": [{"type": "input_image"}]}],
    "/v1/embeddings": [{"input": ["x"] * 2049}, {"input": "x", "encoding_format": "hex"}],
    "/tokenize": [{"messages": []}],
    "/detokenize": [{"tokens": [-1]}],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    bundle = tiny_tokenizer_bundle(tmp_path_factory.mktemp("tokenizer"), 320)
    runner = FakeModelRunner(vocab_size=320, context_window=256, num_pages=256)
    runner.tokenizer = bundle
    engine = Engine(
        runner,
        tokenizer=bundle.tokenizer,
        eos_token_ids=bundle.eos_token_ids,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
    )
    s = serve_engine(engine, ServerOptions(max_body_bytes=64 * 1024))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def document(server):
    return httpx.get(server.base_url + "/openapi.json", timeout=30).json()


def body_validator(document, path):
    """A jsonschema validator of `path`'s documented request body, $refs resolved in the
    document itself."""
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    resource = Resource.from_contents(document, default_specification=DRAFT202012)
    registry = Registry().with_resource("urn:doc", resource)
    ref = schema["schema"]["$ref"].replace("#", "urn:doc#", 1)
    return jsonschema.Draft202012Validator({"$ref": ref}, registry=registry)


def test_every_body_route_documents_its_body_and_no_other_does(document):
    for method, path in ROUTES:
        op = document["paths"].get(path, {}).get(method.lower())
        if path in MODELS:
            body = op["requestBody"]
            assert body["required"] is True
            ref = body["content"]["application/json"]["schema"]["$ref"]
            assert ref == f"#/components/schemas/{MODELS[path].__name__}", path
        elif op is not None:  # the chat page's files are not in the document
            assert "requestBody" not in op, path


@pytest.mark.parametrize("path", sorted(MODELS))
def test_documented_bodies_agree_with_the_models(document, path):
    validator = body_validator(document, path)
    for body in VALID[path]:
        MODELS[path].model_validate(body)
        validator.validate(body)
    for body in INVALID[path]:
        with pytest.raises(Exception):  # noqa: B017 - pydantic's ValidationError
            MODELS[path].model_validate(body)
        assert not validator.is_valid(body), body


def test_error_responses_are_documented_where_they_happen(document):
    for method, path in ROUTES:
        op = document["paths"].get(path, {}).get(method.lower())
        if op is None:
            continue
        statuses = set(op["responses"])
        assert {"200", "400"} <= statuses, path
        assert ("503" in statuses) == (path != "/health/live"), path  # live while draining
        probe = path in {"/health", "/health/live", "/health/ready"}
        assert ("401" in statuses) == (not probe), path
        assert {"404", "413", "415"} <= statuses or path not in MODELS, path
        queued = path in {
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/embeddings",
        }
        assert ("429" in statuses) == queued, path
        if "stream" in MODELS.get(path, protocol.DetokenizeRequest).model_fields:
            assert "text/event-stream" in op["responses"]["200"]["content"], path


def test_what_schemathesis_draws_the_server_parses(document):
    """Positive cases drawn from the document are bodies pydantic accepts: the document is
    no looser than the models (shape only: a valid body may still be refused for its
    meaning, e.g. a token id outside the vocabulary)."""
    schema = schemathesis.openapi.from_dict(document)
    for path, model in MODELS.items():
        op = schema[path]["POST"]
        bodies = []

        @settings(
            max_examples=25,
            database=None,
            phases=[Phase.generate],
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.data())
        def draw(data):
            bodies.append(data.draw(op.as_strategy()).body)  # noqa: B023

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            draw()
        assert len(bodies) >= 10, path
        for body in bodies:
            model.model_validate(as_javascript_writes_it(body))


def as_javascript_writes_it(value):
    """JSON Schema counts 3.0 as an integer; strict pydantic does not (a Python client's
    `3.0`). JSON.stringify and most JSON writers send an integral number as `3`, which is
    what the document's `integer` means in practice."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: as_javascript_writes_it(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_javascript_writes_it(v) for v in value]
    return value


def test_live_answers_conform_to_the_document(server):
    """Schemathesis' checks on real answers: successes (JSON and event streams) and each
    documented error (400, 404, 413, 415) with its OpenAI-shaped body."""
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    json_type = {"Content-Type": "application/json"}
    cases = []
    for path in MODELS:
        op = schema[path]["POST"]
        good = VALID[path][0] if path != "/v1/completions" else {"model": MODEL, "prompt": "x"}
        cases += [
            (op.Case(body=good, headers=json_type), 200),
            (op.Case(body=INVALID[path][0], headers=json_type), 400),
            (op.Case(body={**good, "model": "other"}, headers=json_type), 404),
            (op.Case(body={**good, "pad": "x" * 70_000}, headers=json_type), 413),
            (op.Case(body=good, headers={"Content-Type": "text/plain"}), 415),
        ]
        if "stream" in MODELS[path].model_fields:
            cases.append(
                (op.Case(body={**good, "stream": True, "max_tokens": 3}, headers=json_type), 200)
            )
    for path in ("/v1/models", "/health", "/metrics"):
        cases.append((schema[path]["GET"].Case(), 200))
    for case, status in cases:
        response = case.call(base_url=server.base_url, timeout=30)
        assert response.status_code == status, (case.path, response.text)
        case.validate_response(response, checks=CHECKS)
