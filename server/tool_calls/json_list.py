"""The format for forced calls on a model without a tool-call format of its own: a JSON list
`[{"name": ..., "parameters": {...}}, ...]`, written under a grammar. Never picked from a
chat template; only used when a request forces a call and no other format matches."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .base import ToolCallParser
from .grammar import call_rules
from .readers import CallListReader, CallSink, RegionReader


class JsonListParser(ToolCallParser):
    name = "json_list"
    leading_markers = ("[",)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return False

    def region_reader(self, marker: str, sink: CallSink) -> RegionReader:
        return CallListReader(sink, ("parameters", "arguments"), eager=False)

    def forced_call_grammar(
        self,
        tools: list[dict[str, Any]],
        tool_choice: str | dict[str, Any],
        parallel: bool = True,
        added_tokens: Collection[str] = (),
    ) -> str:
        more = ' (", " call)*' if parallel else ""
        return f'start: "[" call{more} "]"\n' + call_rules(tools, tool_choice, "parameters")
