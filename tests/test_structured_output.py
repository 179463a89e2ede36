"""Structured output through the HTTP API, with the official `openai` client: `response_format`
(json_object, json_schema) and vLLM's `guided_json`/`guided_regex`/`guided_choice`/
`guided_grammar`, on chat and completions, streaming or not.

The server runs over the fake runner, whose logits are random: only the grammar can make an
output valid, so every JSON answer must pass `jsonschema.validate`. One slow test asks the real
default SmolLM2 artifact for a JSON answer."""

from __future__ import annotations

import asyncio
import datetime
import json
import re

import jsonschema
import openai
import pytest
from server_helpers import MODEL, serve_engine, tiny_tokenizer_bundle  # noqa: I001
from structured_output_schemas import SCHEMAS

from tallow.runtime.artifact import TokenizerBundle
from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server.app import ServerOptions

VOCAB = 320
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
TIMEOUT = 60  # seconds per request: a hang fails the test instead of blocking it


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> TokenizerBundle:
    return tiny_tokenizer_bundle(tmp_path_factory.mktemp("tokenizer"), VOCAB)


@pytest.fixture(scope="module")
def server(bundle):
    runner = FakeModelRunner(vocab_size=VOCAB, context_window=4096, num_pages=2048)
    runner.tokenizer = bundle
    engine = Engine(
        runner,
        tokenizer=bundle.tokenizer,
        eos_token_ids=bundle.eos_token_ids,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
    )
    s = serve_engine(engine, ServerOptions())
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT
    )


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT
    )


def check_json(text: str, schema: dict) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    return value


def chat(client, stream: bool, **kw) -> tuple[str, str]:
    """(content, finish_reason) of one chat completion, streamed or not."""
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 1500, "seed": 1, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


def complete(client, stream: bool, **kw) -> tuple[str, str]:
    kw = {"model": MODEL, "prompt": "JSON:", "max_tokens": 1500, "seed": 1, **kw}
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return text, reason


def json_schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# -- JSON ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_chat_outputs_validate(client, name):
    schema = SCHEMAS[name]
    for seed in (1, 2):
        text, reason = chat(
            client, False, seed=seed, response_format=json_schema_format(name, schema)
        )
        assert reason == "stop", text
        value = check_json(text, schema)
        if name == "date":
            datetime.date.fromisoformat(value["born"])


@pytest.mark.parametrize("name", ["nested", "array_of_objects", "all_types", "date", "mixed_enum"])
def test_json_schema_streaming_equals_non_streaming(client, name):
    fmt = json_schema_format(name, SCHEMAS[name])
    streamed = chat(client, True, seed=7, response_format=fmt)
    assert streamed == chat(client, False, seed=7, response_format=fmt)
    check_json(streamed[0], SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_guided_json_on_completions(client, stream):
    for name in ("flat", "int_bounds", "tags"):
        schema = SCHEMAS[name]
        text, reason = complete(client, stream, extra_body={"guided_json": schema})
        assert reason == "stop", text
        check_json(text, schema)
    # a schema given as JSON text works too
    text, _ = complete(client, stream, extra_body={"guided_json": json.dumps(SCHEMAS["enum"])})
    check_json(text, SCHEMAS["enum"])


def test_response_format_on_completions_and_json_object(client):
    fmt = json_schema_format("x", SCHEMAS["const"])
    # the openai client's completions take no response_format argument (vLLM's extension)
    text, reason = complete(client, False, extra_body={"response_format": fmt})
    assert json.loads(text) == {"version": 2, "kind": "tallow"} and reason == "stop"
    for seed in range(3):
        text, reason = chat(
            client, seed % 2 == 1, seed=seed, response_format={"type": "json_object"}
        )
        assert reason == "stop" and isinstance(json.loads(text), dict), text


def test_strict_false_ignores_unimplemented_keywords(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "not": {}}
    fmt = json_schema_format("x", schema)
    with pytest.raises(openai.BadRequestError, match="not"):
        chat(client, False, response_format=fmt)
    fmt["json_schema"]["strict"] = False
    text, reason = chat(client, False, response_format=fmt)
    assert reason == "stop" and isinstance(json.loads(text), dict)


def test_response_format_text_is_unconstrained(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        temperature=0.0,
        response_format={"type": "text"},
        extra_body={"ignore_eos": True},
    )
    plain = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.choices[0].finish_reason == "length"


def test_n2_each_choice_validates(client):
    schema = SCHEMAS["array_bounds"]
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=500,
        seed=3,
        n=2,
        response_format=json_schema_format("a", schema),
    )
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop"
        check_json(c.message.content, schema)


# -- regex, choice, Lark ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_guided_regex(client, stream):
    pattern = r"[A-Z][a-z]{2,5} (19|20)\d\d(-[0-9a-f]{4})?"
    for seed in range(4):
        text, reason = chat(client, stream, seed=seed, extra_body={"guided_regex": pattern})
        assert reason == "stop" and re.fullmatch(pattern, text), text
        text, reason = complete(client, stream, seed=seed, extra_body={"guided_regex": pattern})
        assert reason == "stop" and re.fullmatch(pattern, text), text


@pytest.mark.parametrize("stream", [False, True])
def test_guided_choice(client, stream):
    choices = ["positive", "negative", "neutral", 'with "quotes"', "ünïcode", "new\nline"]
    seen = set()
    for seed in range(12):
        text, reason = chat(client, stream, seed=seed, extra_body={"guided_choice": choices})
        assert reason == "stop" and text in choices, text
        seen.add(text)
    assert len(seen) > 1


LARK = r"""
start: greeting " " names "!"
greeting: "hi" | "hello" | "hey there"
names: name (", " name)*
name: /[A-Z][a-z]{1,5}/
"""
LARK_EQUIVALENT = r"(hi|hello|hey there) [A-Z][a-z]{1,5}(, [A-Z][a-z]{1,5})*!"


@pytest.mark.parametrize("stream", [False, True])
def test_guided_grammar_lark(client, stream):
    for seed in range(4):
        text, reason = chat(client, stream, seed=seed, extra_body={"guided_grammar": LARK})
        assert reason == "stop" and re.fullmatch(LARK_EQUIVALENT, text), text
        text, reason = complete(client, stream, seed=seed, extra_body={"guided_grammar": LARK})
        assert reason == "stop" and re.fullmatch(LARK_EQUIVALENT, text), text


# -- batching --------------------------------------------------------------------------------------


def test_mixed_batch_equals_each_alone(aclient):
    requests = [
        {"response_format": json_schema_format("n", SCHEMAS["nested"]), "seed": 11},
        {"extra_body": {"ignore_eos": True}, "seed": 12, "max_tokens": 40},
        {"extra_body": {"guided_regex": r"\d{3}-\d{4}"}, "seed": 13},
        {"response_format": {"type": "json_object"}, "seed": 14},
        {"extra_body": {"ignore_eos": True}, "temperature": 0.0, "max_tokens": 30},
        {"extra_body": {"guided_choice": ["a", "b", "c"]}, "seed": 15, "n": 2},
        {"extra_body": {"guided_grammar": LARK}, "seed": 16, "top_p": 0.9, "temperature": 0.8},
        {"response_format": json_schema_format("t", SCHEMAS["all_types"]), "seed": 17},
    ]

    async def one(kw):
        kw = {"model": MODEL, "messages": CHAT, "max_tokens": 1500, **kw}
        r = await aclient.chat.completions.create(**kw)
        return [(c.message.content, c.finish_reason) for c in r.choices]

    async def main():
        together = await asyncio.gather(*(one(kw) for kw in requests))
        alone = [await one(kw) for kw in requests]
        return together, alone

    together, alone = asyncio.run(main())
    assert together == alone
    check_json(together[0][0][0], SCHEMAS["nested"])
    assert re.fullmatch(r"\d{3}-\d{4}", together[2][0][0])
    assert together[1][0][1] == "length"


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "param", "needle"),
    [
        ({"response_format": json_schema_format("x", {"type": "nope"})}, "response_format", "nope"),
        ({"extra_body": {"guided_json": {"type": "nope"}}}, "guided_json", "nope"),
        ({"extra_body": {"guided_json": "{not json"}}, "guided_json", "not valid JSON"),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "unclosed group"),
        ({"extra_body": {"guided_grammar": "start: foo"}}, "guided_grammar", "foo"),
        ({"extra_body": {"guided_grammar": "start: ("}}, "guided_grammar", ""),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
            "guided_regex",
            "only one output constraint",
        ),
        (
            {"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}},
            "guided_choice",
            "guided_regex and guided_choice",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", ""),
        ({"extra_body": {"guided_choice": []}}, "guided_choice", ""),
    ],
)
def test_bad_constraints_are_400_then_normal_requests_work(client, kw, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, **kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    assert needle in err["message"], err["message"]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, seed=1)
    assert r.choices[0].message.content is not None
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=50, seed=1, extra_body={"guided_regex": "ok|no"}
    )
    assert r.choices[0].message.content in {"ok", "no"}


@pytest.mark.parametrize("stream", [False, True])
def test_dead_end_grammar_finishes_with_grammar_error(client, stream):
    # The regex can start ("ab") but nothing completes it: a dead end after two tokens at most.
    for pattern in (r"a[^\s\S]", r"ab[^\s\S]"):
        text, reason = chat(client, stream, extra_body={"guided_regex": pattern})
        assert reason == "grammar_error" and text in {"", "a", "ab"}, (text, reason)
    text, reason = chat(client, stream, max_tokens=5, seed=1)  # the server carries on
    assert reason in {"stop", "length"}


# -- the real model --------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_answers_json_schema(smollm2_artifact):
    from server_helpers import start_server

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            # bounded, so the grammar ends the number: unbounded, a 135M model at 4.5 bits
            # can write "1.11888..." digit after digit until max_tokens (seen once)
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 1000},
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": False,
    }
    s = start_server(smollm2_artifact, ServerOptions(), max_num_seqs=4, kv_cache_mem_mb=64)
    try:
        client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="x", max_retries=0, timeout=300)
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
            temperature=0.0,
            max_tokens=120,
            response_format=json_schema_format("capital", schema),
        )
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        check_json(text, schema)
    finally:
        s.stop()
