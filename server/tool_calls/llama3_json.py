"""Llama 3.1-3.3 JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`, if the detokenizer keeps special tokens), several calls
separated by `;`. An answer that does not start with one is plain text.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .base import ToolCallParser, call_from_object, json_values
from .grammar import call_rules

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    leading_markers = (PYTHON_TAG, "{")

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return "<|start_header_id|>" in chat_template and (
            PYTHON_TAG in chat_template or '"parameters"' in chat_template
        )

    def parse_region(self, region: str) -> list[tuple[str, str]] | None:
        values = json_values(region.strip().removeprefix(PYTHON_TAG), separators=";")
        if values is None:
            return None
        calls = [call_from_object(v, "parameters", "arguments") for v in values]
        if any(c is None for c in calls):
            return None
        return calls  # type: ignore[return-value]

    def forced_call_grammar(
        self,
        tools: list[dict[str, Any]],
        tool_choice: str | dict[str, Any],
        parallel: bool = True,
        added_tokens: Collection[str] = (),
    ) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\n" + call_rules(tools, tool_choice, "parameters")
