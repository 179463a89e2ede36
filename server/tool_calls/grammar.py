"""Lark grammars (llguidance's dialect) for forced tool calls, shared by the formats.

llguidance's Lark embeds a JSON schema as a rule body: `name: %json { ... }`. Each tool gets
one rule whose schema pins the function name and holds the tool's parameters schema, so the
model can only write a call to an offered tool with arguments that fit it.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any


def function_name(tool: dict[str, Any]) -> str:
    return tool["function"]["name"]


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def chosen_tools(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]
) -> list[dict[str, Any]]:
    """The tools a forced call may use: all for "required", the named one otherwise."""
    if tool_choice == "required":
        return list(tools)
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        picked = [t for t in tools if function_name(t) == name]
        if picked:
            return picked
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    raise ValueError(f"tool_choice {tool_choice!r} does not force a call")


def call_object_schema(tool: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    """`{"name": <this tool>, "<arguments_key>": <its parameters>}`, name first."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": function_name(tool)},
            arguments_key: parameters_schema(tool),
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def lark_string(text: str) -> str:
    """A Lark string literal for `text` (JSON escapes are valid in Lark strings)."""
    return json.dumps(text)


def tag(text: str, added_tokens: Collection[str]) -> str:
    """A format's tag (`<tool_call>`) in a grammar. llguidance matches a tokenizer's added
    tokens only as those tokens, never as the text they spell (Qwen's `<tool_call>` is one), so
    a tag the tokenizer has as an added token is named as a token (`<tool_call>` unquoted in
    its Lark); any other tag is a string literal."""
    if text in added_tokens and text.startswith("<") and text.endswith(">"):
        return text
    return lark_string(text)


def call_rules(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], arguments_key: str
) -> str:
    """`call: fn_0 | fn_1 ...` plus one `%json` rule per chosen tool."""
    picked = chosen_tools(tools, tool_choice)
    names = [f"fn_{i}" for i in range(len(picked))]
    lines = ["call: " + " | ".join(names)]
    for rule, tool in zip(names, picked, strict=True):
        schema = json.dumps(call_object_schema(tool, arguments_key), ensure_ascii=False)
        lines.append(f"{rule}: %json {schema}")
    return "\n".join(lines) + "\n"
