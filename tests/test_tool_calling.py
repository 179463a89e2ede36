"""Tool calling and reasoning through the server, with the official `openai` client, over the
scripted runner double of `scripted_server.py` (no compile; each test takes milliseconds).

The model is the tiny byte-level tokenizer plus Qwen's added tokens, with a Qwen2.5 tool
template (plus Qwen3's thinking switch in the generation prompt), so the Hermes format and the
think block are both picked up from the template. transformers' `apply_chat_template` is the
oracle for the prompts the server renders.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from scripted_server import (
    CALL,
    PLAIN_TEMPLATE,
    QWEN_TOOL_TEMPLATE,
    TOOLS,
    USER,
    make_bundle,
    say,
    start_scripted,
)
from server_helpers import MODEL  # noqa: I001

from tallow.runtime.artifact import TokenizerBundle
from tallow.server import protocol, protocol_chat

from tiny_models import make_tokenizer


def reassemble(chunks) -> dict:
    """A streamed choice 0 folded into the non-streamed message's fields."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            call = out["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if call["id"] is None:  # a call's first delta: id, type and name
                assert tc.id and tc.type == "function" and tc.function.name, tc
                assert tc.function.arguments is not None
                call["id"], call["name"] = tc.id, tc.function.name
            else:  # then only pieces of the arguments
                assert tc.id is None and tc.type is None and tc.function.name is None, tc
                assert tc.function.arguments
            call["arguments"] += tc.function.arguments
        out["finish"] = choice.finish_reason or out["finish"]
    return out


def as_streamed(message, finish) -> dict:
    return {
        "content": message.content or "",
        "reasoning": getattr(message, "reasoning_content", None) or "",
        "calls": {
            i: {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for i, c in enumerate(message.tool_calls or [])
        },
        "finish": finish,
    }


def no_ids(d: dict) -> dict:
    return {**d, "calls": {i: {**c, "id": None} for i, c in d["calls"].items()}}


def greedy(**kw):
    return {"model": MODEL, "temperature": 0.0, "max_tokens": 200, **kw}


# -- tool calls --------------------------------------------------------------------------------


def test_tool_call_response_and_stream(qwen, qwen_client):
    say(qwen, "Let me look that up.\n" + CALL)
    r = qwen_client.chat.completions.create(messages=USER, tools=TOOLS, **greedy())
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look that up."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert call.function.arguments == '{"city": "Paris", "unit": "celsius"}'  # as written
    body = r.model_dump(exclude_unset=True)
    protocol_chat.ChatCompletionResponse.model_validate(body)
    chunks = list(
        qwen_client.chat.completions.create(messages=USER, tools=TOOLS, stream=True, **greedy())
    )
    streamed = reassemble(chunks)
    assert no_ids(streamed) == no_ids(as_streamed(choice.message, "tool_calls"))
    assert streamed["calls"][0]["id"].startswith("call_")
    # The call streams as OpenAI's do: the name first, before the arguments are complete, then
    # the arguments in pieces.
    deltas = [
        tc.function.arguments
        for c in chunks
        if c.choices
        for tc in c.choices[0].delta.tool_calls or []
    ]
    assert deltas[0] == "" and len(deltas) > 5
    assert "".join(deltas) == call.function.arguments


def test_two_calls_and_plain_answers(qwen, qwen_client):
    second = CALL.replace("Paris", "Oslo")
    say(qwen, CALL + "\n" + second)
    r = qwen_client.chat.completions.create(messages=USER, tools=TOOLS, **greedy())
    assert r.choices[0].message.content is None
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == [
        "Paris",
        "Oslo",
    ]
    streamed = reassemble(
        qwen_client.chat.completions.create(messages=USER, tools=TOOLS, stream=True, **greedy())
    )
    assert no_ids(streamed) == no_ids(as_streamed(r.choices[0].message, "tool_calls"))
    # parallel_tool_calls=false keeps the first call only.
    one = qwen_client.chat.completions.create(
        messages=USER, tools=TOOLS, parallel_tool_calls=False, **greedy()
    )
    assert len(one.choices[0].message.tool_calls) == 1
    # tool_choice none: the text is returned as it is.
    none = qwen_client.chat.completions.create(
        messages=USER, tools=TOOLS, tool_choice="none", **greedy()
    )
    assert (
        none.choices[0].message.tool_calls is None
        and "<tool_call>" in none.choices[0].message.content
    )
    assert none.choices[0].finish_reason == "stop"
    # Malformed JSON before the call's name is known: plain content, both ways.
    bad = '<tool_call>\n{"arguments": {"city": }, "name": "get_weather"}\n</tool_call>'
    say(qwen, bad)
    r = qwen_client.chat.completions.create(messages=USER, tools=TOOLS, **greedy())
    assert r.choices[0].message.content == bad and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    s = reassemble(
        qwen_client.chat.completions.create(messages=USER, tools=TOOLS, stream=True, **greedy())
    )
    assert s == as_streamed(r.choices[0].message, "stop")
    # ... and after it: the call ends with the arguments sent so far, the rest is content.
    say(qwen, '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>')
    r = qwen_client.chat.completions.create(messages=USER, tools=TOOLS, **greedy())
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": ')
    assert r.choices[0].message.content == "}\n</tool_call>"
    assert r.choices[0].finish_reason == "tool_calls"
    s = reassemble(
        qwen_client.chat.completions.create(messages=USER, tools=TOOLS, stream=True, **greedy())
    )
    assert no_ids(s) == no_ids(as_streamed(r.choices[0].message, "tool_calls"))


def test_tool_round_trip_renders_like_transformers(qwen, qwen_client):
    transformers = pytest.importorskip("transformers")
    _, runner, bundle = qwen
    say(qwen, "It is 18 degrees in Paris.")
    convo = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc123",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc123", "content": '{"temp": 18}'},
    ]
    r = qwen_client.chat.completions.create(messages=convo, tools=TOOLS, **greedy())
    assert r.choices[0].message.content == "It is 18 degrees in Paris."
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bundle.tokenizer, chat_template=QWEN_TOOL_TEMPLATE, eos_token="<|im_end|>"
    )
    # transformers' documented message format: a call's arguments are an object, not JSON text.
    hf_convo = json.loads(json.dumps(convo))
    hf_convo[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    expected = hf.apply_chat_template(
        hf_convo, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert '<tool_response>\n{"temp": 18}\n</tool_response>' in expected
    assert '"arguments": {"city": "Paris"}}' in expected
    ids = bundle.tokenizer.encode(expected, add_special_tokens=False).ids
    assert runner.last_prompt == ids
    assert r.usage.prompt_tokens == len(ids)
    # Template kwargs reach the template as apply_chat_template's kwargs do.
    qwen_client.chat.completions.create(
        messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **greedy()
    )
    expected = hf.apply_chat_template(
        USER, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert expected.endswith("<think>\n\n</think>\n\n")
    assert runner.last_prompt == bundle.tokenizer.encode(expected, add_special_tokens=False).ids


# -- reasoning ---------------------------------------------------------------------------------


def test_reasoning_split_streaming_and_not(qwen, qwen_client):
    _, _, bundle = qwen
    text = "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny."
    say(qwen, text)
    ids = bundle.tokenizer.encode(text, add_special_tokens=False).ids
    assert bundle.tokenizer.token_to_id("<think>") in ids  # the tags are single tokens here
    r = qwen_client.chat.completions.create(messages=USER, **greedy())
    msg = r.choices[0].message
    assert msg.reasoning_content == "The user asks about Paris." and msg.content == "It is sunny."
    streamed = reassemble(
        qwen_client.chat.completions.create(messages=USER, stream=True, **greedy())
    )
    assert streamed == as_streamed(msg, "stop")


def test_reasoning_tags_split_across_tokens(tmp_path):
    # Without the added tokens, `<think>` and `</think>` are several tokens each.
    bundle = make_bundle(tmp_path, QWEN_TOOL_TEMPLATE)
    from tokenizers import Tokenizer

    (tmp_path / "plain").mkdir()
    make_tokenizer(tmp_path / "plain", 320)
    plain = Tokenizer.from_file(str(tmp_path / "plain" / "tokenizer.json"))
    plain.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    bundle = TokenizerBundle(**{**bundle.__dict__, "tokenizer": plain})
    server, runner = start_scripted(bundle)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        text = "Paris is in France, so\n</think>\n\nIt is sunny." + "\n" + CALL
        runner.script = plain.encode(text, add_special_tokens=False).ids
        assert len(plain.encode("</think>", add_special_tokens=False).ids) > 1
        kw = {"chat_template_kwargs": {"open_think": True}}  # generation starts inside
        r = client.chat.completions.create(messages=USER, tools=TOOLS, extra_body=kw, **greedy())
        msg = r.choices[0].message
        assert msg.reasoning_content == "Paris is in France, so"
        assert msg.content == "It is sunny." and msg.tool_calls[0].function.name == "get_weather"
        chunks = list(
            client.chat.completions.create(
                messages=USER, tools=TOOLS, extra_body=kw, stream=True, **greedy()
            )
        )
        assert no_ids(reassemble(chunks)) == no_ids(as_streamed(msg, "tool_calls"))
        assert (
            sum(
                bool(c.choices and getattr(c.choices[0].delta, "reasoning_content", None))
                for c in chunks
            )
            > 1
        )
    finally:
        server.stop()


# -- forcing -----------------------------------------------------------------------------------


def test_forcing_puts_a_grammar_on_the_params(qwen, monkeypatch):
    from tallow.server import prompts

    seen = []
    real = prompts.forced_tool_grammar
    monkeypatch.setattr(
        prompts, "forced_tool_grammar", lambda *a: seen.append(real(*a)) or seen[-1]
    )
    server, _, _ = qwen
    say(qwen, CALL)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in (("required", None), (named, False)):
        body = {**greedy(), "messages": USER, "tools": TOOLS, "tool_choice": choice}
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert len(seen) == 2 and all("%json" in g and "<tool_call>" in g for g in seen)
    assert '("\\n"' in seen[0] and '("\\n"' not in seen[1]  # parallel calls only when allowed


def test_forced_call_follows_the_schema(qwen, qwen_client):
    # The script opens with plain text; the grammar must make the model call the tool at once
    # (the runner double then resumes its script inside the call).
    _, runner, _ = qwen
    say(qwen, "Sure! " + CALL)
    runner.resume = True
    try:
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in (named, "required"):
            r = qwen_client.chat.completions.create(
                messages=USER, tools=TOOLS, tool_choice=choice, **greedy()
            )
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].message.content is None
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments)["city"] == "Paris"
            assert r.choices[0].finish_reason == "tool_calls"
            streamed = reassemble(
                qwen_client.chat.completions.create(
                    messages=USER, tools=TOOLS, tool_choice=choice, stream=True, **greedy()
                )
            )
            assert no_ids(streamed) == no_ids(as_streamed(r.choices[0].message, "tool_calls"))
    finally:
        runner.resume = False


# -- bad input ---------------------------------------------------------------------------------


def test_bad_tool_requests(qwen, qwen_client, tmp_path):
    server, _, _ = qwen
    url = f"{server.base_url}/v1/chat/completions"
    string_params = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    ]
    unknown = {"type": "function", "function": {"name": "nope"}}
    cases = [
        ({"tools": TOOLS, "tool_choice": unknown}, "tool_choice"),
        ({"tools": string_params}, "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ]
    for extra, param in cases:
        r = httpx.post(url, json={**greedy(), "messages": USER, **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
        protocol.ErrorResponse.model_validate(r.json())
    with pytest.raises(openai.BadRequestError) as e:
        qwen_client.chat.completions.create(
            messages=USER, tools=TOOLS, tool_choice=unknown, **greedy()
        )
    assert "nope" in e.value.message
    say(qwen, "Fine.")
    assert qwen_client.chat.completions.create(messages=USER, **greedy()).choices[0].message.content


def test_tools_on_a_template_without_tool_support(tmp_path):
    server, runner = start_scripted(make_bundle(tmp_path, PLAIN_TEMPLATE))
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(messages=USER, tools=TOOLS, **greedy())
        assert e.value.code == "tools_not_supported" and "tool_choice" in e.value.message
        # Forcing a call works without a template format: the generic JSON list.
        runner.script = server.engine.tokenizer.encode(
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}]', add_special_tokens=False
        ).ids
        r = client.chat.completions.create(
            messages=USER, tools=TOOLS, tool_choice="required", **greedy()
        )
        assert r.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
        runner.script = server.engine.tokenizer.encode("Hi.", add_special_tokens=False).ids
        r = client.chat.completions.create(messages=USER, **greedy())
        assert r.choices[0].message.content == "Hi." and r.choices[0].message.tool_calls is None
    finally:
        server.stop()
