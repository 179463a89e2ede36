"""The format for forced calls on a model without a tool-call format of its own: a JSON list
`[{"name": ..., "parameters": {...}}, ...]`, written under a grammar. Never picked from a
chat template; only used when a request forces a call and no other format matches."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .base import ToolCallParser, call_from_object, json_values
from .grammar import call_rules


class JsonListParser(ToolCallParser):
    name = "json_list"
    leading_markers = ("[",)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return False

    def parse_region(self, region: str) -> list[tuple[str, str]] | None:
        values = json_values(region)
        if values is None or len(values) != 1 or not isinstance(values[0], list):
            return None
        calls = [call_from_object(v, "parameters", "arguments") for v in values[0]]
        if not calls or any(c is None for c in calls):
            return None
        return calls  # type: ignore[return-value]

    def forced_call_grammar(
        self,
        tools: list[dict[str, Any]],
        tool_choice: str | dict[str, Any],
        parallel: bool = True,
        added_tokens: Collection[str] = (),
    ) -> str:
        more = ' (", " call)*' if parallel else ""
        return f'start: "[" call{more} "]"\n' + call_rules(tools, tool_choice, "parameters")
