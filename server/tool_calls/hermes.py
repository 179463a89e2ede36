"""Hermes-style tool calls (Hermes 2 Pro, Qwen2.5, Qwen3): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, after any text.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from .base import ToolCallParser, call_from_object
from .grammar import call_rules, tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallParser):
    name = "hermes"
    start_markers = (OPEN,)
    end_marker = CLOSE

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return OPEN in chat_template and CLOSE in chat_template

    def parse_region(self, region: str) -> list[tuple[str, str]] | None:
        body = region.removeprefix(OPEN).removesuffix(CLOSE).strip()
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        call = call_from_object(obj, "arguments", "parameters")
        return None if call is None else [call]

    def forced_call_grammar(
        self,
        tools: list[dict[str, Any]],
        tool_choice: str | dict[str, Any],
        parallel: bool = True,
        added_tokens: Collection[str] = (),
    ) -> str:
        block = f'{tag(OPEN, added_tokens)} "\\n" call "\\n" {tag(CLOSE, added_tokens)}'
        more = f' ("\\n" {block})*' if parallel else ""
        return f"start: {block}{more}\n" + call_rules(tools, tool_choice, "arguments")
