"""Tool-call formats, one module each, picked from the model's chat template.

`parser_for_template(template)` is the one place that maps a template to a format; a new
format is a module with a `ToolCallParser` subclass plus an entry in `TOOL_PARSERS`.
"""

from __future__ import annotations

from collections.abc import Collection

from .base import ToolCallParser
from .deltas import StreamDelta, ToolCall, ToolCallDelta
from .hermes import HermesParser
from .json_list import JsonListParser
from .llama3_json import Llama3JsonParser
from .mistral import MistralParser
from .stream import ToolCallStream

# Checked in order; the first that matches wins (Mistral's marker is the most specific).
TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (MistralParser, HermesParser, Llama3JsonParser)
}


def parser_for_template(
    template: str | None, tool_names: Collection[str] = ()
) -> ToolCallParser | None:
    """The tool-call format of a model with this chat template, or None if none is known;
    `tool_names` are the request's tools (see `ToolCallParser.tool_names`)."""
    if not template:
        return None
    for parser in TOOL_PARSERS.values():
        if parser.matches(template):
            return parser(tool_names)
    return None


__all__ = [
    "TOOL_PARSERS",
    "HermesParser",
    "JsonListParser",
    "Llama3JsonParser",
    "MistralParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallStream",
    "parser_for_template",
]
