"""`POST /v1/responses` with the official `openai` client, over the scripted runner double of
`scripted_server.py` (a Qwen-style tool template with a think block; no compile).

`openai.types.responses` is the oracle for every body and stream event; transformers'
`apply_chat_template` is the oracle for the prompts the input items render to.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from responses_helpers import (
    QUESTION,
    RESP_TOOLS,
    flatten,
    greedy,
    hf_tokenizer,
    no_ids,
    parse_response,
    post,
    reassemble,
    streamed_and_not,
)
from scripted_server import CALL, TOOLS, say
from server_helpers import MODEL  # noqa: I001

# -- text --------------------------------------------------------------------------------------


def test_text_in_text_out(qwen, qwen_client):
    server, runner, bundle = qwen
    say(qwen, "Hello there.")
    r = qwen_client.responses.create(input="Hi!", **greedy())
    assert r.output_text == "Hello there." and r.status == "completed"
    assert r.id.startswith("resp_") and r.object == "response"
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert msg.id.startswith("msg_") and msg.content[0].type == "output_text"
    assert r.usage.output_tokens == len(runner.script) + 1  # and the EOS
    assert r.usage.input_tokens == len(runner.last_prompt)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    body = post(server, greedy(input="Hi!", metadata={"k": "v"}, store=True)).json()
    parse_response(body)
    assert body["metadata"] == {"k": "v"}
    assert body["text"] == {"format": {"type": "text"}} and body["tool_choice"] == "auto"
    assert body["incomplete_details"] is None and body["error"] is None


def test_instructions_and_items_render_as_chat_messages(qwen, qwen_client):
    server, runner, bundle = qwen
    say(qwen, "Fine.")
    qwen_client.responses.create(instructions="Be brief.", input="Hi!", **greedy())
    by_responses = runner.last_prompt
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": chat}).json()["tokens"]
    assert by_responses == tokens
    expected = hf_tokenizer(bundle).apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert by_responses == bundle.tokenizer.encode(expected, add_special_tokens=False).ids
    # The same conversation as input items (parts, a typed message) renders the same.
    items = [
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be "}]},
        {"role": "user", "content": "Hi!"},
    ]
    items[0]["content"].append({"type": "input_text", "text": "brief."})
    qwen_client.responses.create(input=items, **greedy())
    assert runner.last_prompt == tokens
    # The chat route renders that conversation alike.
    qwen_client.chat.completions.create(messages=chat, model=MODEL, max_tokens=5)
    assert runner.last_prompt == tokens


# -- tool calls --------------------------------------------------------------------------------


def test_function_call_round_trip(qwen, qwen_client):
    _, runner, bundle = qwen
    say(qwen, "Let me check.\n" + CALL)
    r = qwen_client.responses.create(input=QUESTION, tools=RESP_TOOLS, **greedy())
    assert [i.type for i in r.output] == ["message", "function_call"]
    assert r.output_text == "Let me check."
    call = r.output[1]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    # Send the output back with the result, as clients do.
    say(qwen, "It is 18 degrees in Paris.")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 18}'}
    history = [
        {"role": "user", "content": QUESTION},
        *[i.model_dump(exclude_none=True) for i in r.output],
        result,
    ]
    r2 = qwen_client.responses.create(input=history, tools=RESP_TOOLS, **greedy())
    assert r2.output_text == "It is 18 degrees in Paris." and len(r2.output) == 1
    chat = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.loads(call.arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 18}'},
    ]
    expected = hf_tokenizer(bundle).apply_chat_template(
        chat, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert '<tool_response>\n{"temp": 18}\n</tool_response>' in expected
    assert runner.last_prompt == bundle.tokenizer.encode(expected, add_special_tokens=False).ids
    # Calls alone (no text) join one assistant turn; parallel_tool_calls=false keeps one.
    say(qwen, CALL + "\n" + CALL.replace("Paris", "Oslo"))
    r = qwen_client.responses.create(input=QUESTION, tools=RESP_TOOLS, **greedy())
    assert [i.type for i in r.output] == ["function_call", "function_call"] and not r.output_text
    one = qwen_client.responses.create(
        input=QUESTION, tools=RESP_TOOLS, parallel_tool_calls=False, **greedy()
    )
    assert [i.type for i in one.output] == ["function_call"] and one.parallel_tool_calls is False


def test_forced_tool_choice_puts_a_grammar_on_the_params(qwen, monkeypatch):
    from tallow.server import prompts

    seen = []
    real = prompts.forced_tool_grammar
    monkeypatch.setattr(
        prompts, "forced_tool_grammar", lambda *a: seen.append(real(*a)) or seen[-1]
    )
    server, _, _ = qwen
    say(qwen, CALL)
    named = {"type": "function", "name": "get_weather"}
    for choice in ("required", named):
        r = post(server, greedy(input=QUESTION, tools=RESP_TOOLS, tool_choice=choice))
        assert r.status_code == 200, r.text
        assert parse_response(r.json()).output[0].type == "function_call"
        assert r.json()["tool_choice"] == choice
    assert len(seen) == 2 and all("<tool_call>" in g for g in seen)


# -- reasoning ---------------------------------------------------------------------------------


def test_reasoning_item(qwen, qwen_client):
    say(qwen, "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny.")
    r = qwen_client.responses.create(input=QUESTION, reasoning={"effort": "low"}, **greedy())
    assert [i.type for i in r.output] == ["reasoning", "message"]
    thought = r.output[0]
    assert thought.id.startswith("rs_") and thought.summary == []
    assert thought.content[0].type == "reasoning_text"
    assert thought.content[0].text == "The user asks about Paris."
    assert r.output_text == "It is sunny."
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert r.reasoning.effort == "low"


# -- streaming ---------------------------------------------------------------------------------

SCRIPTS = [
    "Hello there.",
    "Let me check.\n" + CALL + "\nOne moment.",
    "<think>\nParis, so\nlet me look.\n</think>\n\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"),
    "",
]


SCRIPT_IDS = ["text", "call", "reasoning+calls", "empty"]


def request_id(script: str) -> str:
    return SCRIPT_IDS[SCRIPTS.index(script)]


@pytest.mark.parametrize("script", SCRIPTS, ids=SCRIPT_IDS)
def test_stream_reassembles_to_the_response(qwen, script):
    say(qwen, script)
    full, events = streamed_and_not(qwen, greedy(input=QUESTION, tools=RESP_TOOLS))
    parse_response(full)
    types = [i["type"] for i in full["output"]]
    assert (
        types
        == {
            "text": ["message"],
            "call": ["message", "function_call", "message"],
            "reasoning+calls": ["reasoning", "function_call", "function_call"],
            "empty": ["message"],
        }[request_id(script)]
    )
    final = events[-1]
    assert final["type"] == "response.completed"
    assert no_ids(final["response"]) == no_ids(full)
    assert reassemble(events) == flatten(full["output"])
    # Each item: added, then its deltas, then done, before the next starts.
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == list(range(len(full["output"])))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["response"]["output"]
    for e in events[:2]:
        assert e["response"]["status"] == "in_progress" and e["response"]["output"] == []
    check_call_events(events, final["response"]["output"])


def check_call_events(events: list[dict], output: list[dict]) -> None:
    """Each function_call item is added with its name and empty arguments, then gets its
    arguments in several `response.function_call_arguments.delta` pieces, then `.done`."""
    for index, item in enumerate(output):
        if item["type"] != "function_call":
            continue
        mine = [e for e in events if e.get("output_index") == index]
        kinds = [e["type"] for e in mine]
        assert kinds[0] == "response.output_item.added" and kinds[-1] == (
            "response.output_item.done"
        )
        added = mine[0]["item"]
        assert (added["name"], added["arguments"], added["status"]) == (
            item["name"],
            "",
            "in_progress",
        )
        assert added["call_id"] == item["call_id"] and added["id"] == item["id"]
        deltas = [e for e in mine if e["type"] == "response.function_call_arguments.delta"]
        assert kinds[1 : 1 + len(deltas)] == [d["type"] for d in deltas] and len(deltas) > 1
        assert all(d["item_id"] == item["id"] for d in deltas)
        assert "".join(d["delta"] for d in deltas) == item["arguments"]
        assert kinds[1 + len(deltas) :] == [
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        assert mine[-2]["arguments"] == item["arguments"]


def test_items_keep_the_order_written_however_the_text_is_split():
    """One delta holding a call's end and the text after it still gives call, then message."""
    from tallow.server.chat_output import ChatOutputOptions
    from tallow.server.formatters.responses import OutputBuilder
    from tallow.server.tool_calls import HermesParser

    text = "Let me check.\n" + CALL + "\nOne moment."
    results = []
    for pieces in ([text], list(text), [text[:60], text[60:]]):
        builder = OutputBuilder(ChatOutputOptions(tool_parser=HermesParser()))
        for i, piece in enumerate(pieces):
            builder.feed(piece, "stop" if i == len(pieces) - 1 else None)
        builder.close()
        out = [i.model_dump() for i in builder.items]
        results.append(no_ids({"output": out})["output"])
    assert [i["type"] for i in results[0]] == ["message", "function_call", "message"]
    assert results[0] == results[1] == results[2]
    assert results[0][2]["content"][0]["text"].strip() == "One moment."


def test_sdk_streams(qwen, qwen_client):
    say(qwen, "<think>\nHm.\n</think>\n\nIt is sunny.")
    plain = qwen_client.responses.create(input=QUESTION, **greedy())
    events = list(qwen_client.responses.create(input=QUESTION, stream=True, **greedy()))
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        "It is sunny."
    )
    with qwen_client.responses.stream(input=QUESTION, **greedy()) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and final.output_text == plain.output_text
    parsed = final.model_dump(mode="json")
    for part in parsed["output"][1]["content"]:
        assert part.pop("parsed") is None  # the SDK's own addition (text.format parsing)
    assert no_ids(parsed) == no_ids(plain.model_dump(mode="json"))


# -- max_output_tokens -------------------------------------------------------------------------


def test_max_output_tokens_makes_it_incomplete(qwen, qwen_client):
    say(qwen, "This answer is much longer than three tokens.")
    r = qwen_client.responses.create(input=QUESTION, **greedy(max_output_tokens=3))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    assert r.output_text and "This answer".startswith(r.output_text)
    full, events = streamed_and_not(qwen, greedy(input=QUESTION, max_output_tokens=3))
    assert events[-1]["type"] == "response.incomplete"
    assert no_ids(events[-1]["response"]) == no_ids(full)
    # Cut while thinking: the reasoning item only.
    say(qwen, "<think>\nA long thought about the weather.\n</think>\n\nSunny.")
    r = qwen_client.responses.create(input=QUESTION, **greedy(max_output_tokens=4))
    assert [i.type for i in r.output] == ["reasoning"] and r.status == "incomplete"


# -- text.format -------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}


def test_text_format_attaches_a_json_grammar(qwen, monkeypatch):
    from tallow.server import prompts_responses

    seen = []
    monkeypatch.setattr(
        prompts_responses, "attach_text_format_grammar", lambda p, f, m: seen.append(f) or True
    )
    server, _, _ = qwen
    say(qwen, '{"city": "Paris"}')
    for fmt in (JSON_SCHEMA, {"type": "json_object"}, {"type": "text"}):
        r = post(server, greedy(input=QUESTION, text={"format": fmt}))
        assert r.status_code == 200, r.text
        assert parse_response(r.json()).text.format.type == fmt["type"]
        assert r.json()["text"]["format"] == fmt
    # With tools the model may call, the JSON grammar would rule calls out: not attached.
    post(server, greedy(input=QUESTION, tools=RESP_TOOLS, text={"format": JSON_SCHEMA}))
    assert [f.type for f in seen] == ["json_schema", "json_object"]
    assert seen[0].schema_ == SCHEMA and seen[0].strict is True


def test_json_schema_is_enforced(qwen, qwen_client):
    say(qwen, '{"city": "Paris"}')
    r = qwen_client.responses.create(input=QUESTION, text={"format": JSON_SCHEMA}, **greedy())
    assert json.loads(r.output_text) == {"city": "Paris"}
    bad = {**JSON_SCHEMA, "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}
    with pytest.raises(openai.BadRequestError) as e:
        qwen_client.responses.create(input=QUESTION, text={"format": bad}, **greedy())
    assert e.value.body["param"] == "text"


# -- bad input ---------------------------------------------------------------------------------


def test_bad_requests_are_400s(qwen, qwen_client):
    server, _, _ = qwen
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    cases = [
        ({"input": [{"role": "user", "content": [image]}]}, "input"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "{}"}]}, "input"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": RESP_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [RESP_TOOLS[0], RESP_TOOLS[0]]}, "tools"),
        ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ]
    for extra, param in cases:
        r = post(server, {**greedy(input=QUESTION), **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (extra, err)
        assert err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        qwen_client.responses.create(input=QUESTION, previous_response_id="resp_1", **greedy())
    assert "stores no responses" in e.value.message
    with pytest.raises(openai.NotFoundError):
        qwen_client.responses.create(input=QUESTION, **greedy(model="other"))
    say(qwen, "Still here.")
    assert qwen_client.responses.create(input=QUESTION, **greedy()).output_text == "Still here."
