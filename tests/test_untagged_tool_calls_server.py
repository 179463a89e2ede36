"""Untagged Hermes calls (issue 33, item 9) through the server, with the official `openai`
client, streaming and not, on the chat and Responses APIs, over the scripted Qwen2.5 tool
template of `scripted_server.py`. The model answers with the bare call object that
Qwen2.5-0.5B-Instruct writes (`UNTAGGED`); the parser's rule itself is tested in
`test_untagged_tool_calls.py`.
"""

from __future__ import annotations

import json

import pytest
from responses_helpers import QUESTION, RESP_TOOLS, no_ids, parse_response, streamed_and_not
from scripted_server import TOOLS, USER, say
from server_helpers import MODEL  # noqa: I001

UNTAGGED = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def greedy(**kw):
    return {"model": MODEL, "temperature": 0.0, "max_tokens": 200, **kw}


def chat(client, stream: bool, **kw):
    """(content, [(name, arguments)], finish_reason, content deltas) of choice 0."""
    r = client.chat.completions.create(messages=USER, stream=stream, **greedy(**kw))
    if not stream:
        m, finish = r.choices[0].message, r.choices[0].finish_reason
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        assert all(c.type == "function" and c.id.startswith("call_") for c in m.tool_calls or [])
        return m.content, calls, finish, None
    pieces, calls, finish = [], {}, None
    for chunk in r:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            pieces.append(choice.delta.content)
        for tc in choice.delta.tool_calls or []:
            if tc.id is not None:
                assert tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    content = "".join(pieces) or None
    return content, [tuple(c) for _, c in sorted(calls.items())], finish, pieces


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_untagged_call_is_a_tool_call(qwen, qwen_client, stream):
    say(qwen, UNTAGGED)
    content, calls, finish, pieces = chat(qwen_client, stream, tools=TOOLS, tool_choice="auto")
    assert (content, finish) == (None, "tool_calls")
    ((name, arguments),) = calls
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert arguments == '{"city": "Paris"}'  # the model's own text
    assert not pieces  # nothing of the object leaked as content deltas
    # Several calls, one per line; parallel_tool_calls=false keeps the first.
    say(qwen, UNTAGGED + '\n{"name": "get_time", "arguments": {}}')
    both = chat(qwen_client, stream, tools=[*TOOLS, TIME_TOOL])
    assert both[1] == [("get_weather", arguments), ("get_time", "{}")]
    one = chat(qwen_client, stream, tools=[*TOOLS, TIME_TOOL], parallel_tool_calls=False)
    assert one[1] == [("get_weather", arguments)] and one[2] == "tool_calls"
    # Text after the call is content.
    say(qwen, UNTAGGED + "\nChecking the weather.")
    assert chat(qwen_client, stream, tools=TOOLS)[:3] == (
        "Checking the weather.",
        [("get_weather", arguments)],
        "tool_calls",
    )
    # A normal request after it.
    say(qwen, "It is sunny.")
    assert chat(qwen_client, stream)[:3] == ("It is sunny.", [], "stop")


NOT_CALLS = [
    '{"name": "get_wind", "arguments": {"city": "Paris"}}',  # not one of the request's tools
    '{"name": "get_weather", "arguments": {"city": Paris}}',  # invalid JSON
    "Here it is: " + UNTAGGED,  # not at the start
    '{"arguments": {"city": "Paris"}, "name": "get_weather"}',
    '  {"city": "Paris", "forecast": ["sun", "rain"]}\n',
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("text", NOT_CALLS)
def test_anything_else_is_text_byte_for_byte(qwen, qwen_client, text, stream):
    say(qwen, text)
    content, calls, finish, pieces = chat(qwen_client, stream, tools=TOOLS)
    assert (content, calls, finish) == (text, [], "stop")
    if stream:
        assert len(pieces) > 1  # streamed as it came, not held to the end


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_no_tools_no_calls(qwen, qwen_client, stream):
    say(qwen, UNTAGGED)
    assert chat(qwen_client, stream)[:3] == (UNTAGGED, [], "stop")
    assert chat(qwen_client, stream, tools=TOOLS, tool_choice="none")[:3] == (
        UNTAGGED,
        [],
        "stop",
    )


def test_cut_by_max_tokens_is_text(qwen, qwen_client):
    say(qwen, UNTAGGED)
    for stream in (False, True):
        content, calls, finish, _ = chat(qwen_client, stream, tools=TOOLS, max_tokens=20)
        assert calls == [] and finish == "length" and UNTAGGED.startswith(content)


def test_responses_api(qwen, qwen_client):
    say(qwen, UNTAGGED)
    r = qwen_client.responses.create(
        model=MODEL, input=QUESTION, tools=RESP_TOOLS, temperature=0.0, max_output_tokens=200
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == '{"city": "Paris"}' and not r.output_text
    body = {"model": MODEL, "input": QUESTION, "tools": RESP_TOOLS, "temperature": 0.0}
    full, events = streamed_and_not(qwen, body)
    parse_response(full)
    assert no_ids(events[-1]["response"]) == no_ids(full)
    assert [i["type"] for i in full["output"]] == ["function_call"]
    kinds = [e["type"] for e in events]
    assert "response.output_text.delta" not in kinds
    args = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(args) == '{"city": "Paris"}'
    # A reply that is no call: one message with the text as written, streamed as it came.
    text = NOT_CALLS[0]
    say(qwen, text)
    full, events = streamed_and_not(qwen, body)
    assert [i["type"] for i in full["output"]] == ["message"]
    assert full["output"][0]["content"][0]["text"] == text
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == text and len(deltas) > 1
