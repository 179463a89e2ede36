"""Helpers of the Responses API tests: requests, the `openai.types.responses` checks every body
and stream event goes through, and reassembling a stream into the response it stands for.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter
from scripted_server import QWEN_TOOL_TEMPLATE, TOOLS
from server_helpers import MODEL  # noqa: I001

from tallow.server import protocol_responses

RESP_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
QUESTION = "What is the weather in Paris?"
EVENTS = TypeAdapter(ResponseStreamEvent)


def greedy(**kw):
    return {"model": MODEL, "temperature": 0.0, "max_output_tokens": 200, **kw}


def hf_tokenizer(bundle):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bundle.tokenizer, chat_template=QWEN_TOOL_TEMPLATE, eos_token="<|im_end|>"
    )


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=30)


def known_keys(model: BaseModel, body: dict) -> None:
    """Every key of `body` is a field of the SDK type it parsed as (one level down too)."""
    fields = {f.alias or name for name, f in type(model).model_fields.items()}
    assert set(body) <= fields, (type(model).__name__, set(body) - fields)
    for key, value in body.items():
        sub = getattr(model, key, None)
        if isinstance(value, dict) and isinstance(sub, BaseModel):
            known_keys(sub, value)
        if isinstance(value, list) and isinstance(sub, list):
            for v, s in zip(value, sub, strict=True):
                if isinstance(v, dict) and isinstance(s, BaseModel):
                    known_keys(s, v)


def parse_response(body: dict) -> Response:
    r = Response.model_validate(body)
    known_keys(r, body)
    protocol_responses.ResponseObject.model_validate(body)
    return r


def sse_events(response: httpx.Response) -> list[dict]:
    """The stream's events; each `event:` line names its data's type."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        body = json.loads(data.removeprefix("data: "))
        assert body["type"] == name.removeprefix("event: ")
        events.append(body)
    return events


def check_events(events: list[dict]) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    for body in events:
        known_keys(EVENTS.validate_python(body), body)


def no_ids(body: dict) -> dict:
    """A response without what differs between two runs: ids and clocks."""
    body = json.loads(json.dumps(body))
    for key in ("id", "created_at", "completed_at"):
        body.pop(key, None)
    for item in body["output"]:
        item.pop("id")
        item.pop("call_id", None)
    return body


def streamed_and_not(qwen, body: dict) -> tuple[dict, list[dict]]:
    server, _, _ = qwen
    full = post(server, body)
    assert full.status_code == 200, full.text
    events = sse_events(post(server, {**body, "stream": True}))
    check_events(events)
    return full.json(), events


def reassemble(events: list[dict]) -> dict:
    """The output items rebuilt from the deltas alone."""
    items: dict[int, dict] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            items[e["output_index"]] = {"type": e["item"]["type"], "text": ""}
        elif e["type"].endswith(".delta"):  # output text, reasoning text, call arguments
            items[e["output_index"]]["text"] += e["delta"]
    return items


def flatten(output: list[dict]) -> dict:
    out = {}
    for i, item in enumerate(output):
        if item["type"] == "function_call":
            text = item["arguments"]
        else:
            text = "".join(p["text"] for p in item["content"])
        out[i] = {"type": item["type"], "text": text}
    return out
