"""Hermes-style tool calls (Hermes 2 Pro, Qwen2.5, Qwen3): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, after any text.
A region may end right after the object (a model may stop before the closing tag).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .base import ToolCallParser
from .grammar import call_rules, tag
from .readers import CallObjectReader, CallSink, Literal, RegionReader, is_space

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


class HermesReader(RegionReader):
    """`<tool_call>`, spaces, one call object, spaces, `</tool_call>`."""

    def __init__(self, sink: CallSink) -> None:
        self._sink = sink
        self._tag = Literal(OPEN)
        self._call: CallObjectReader | None = None
        self._close: Literal | None = None

    @property
    def complete(self) -> bool:
        return self._call is not None and self._call.done and self._close is None

    def feed(self, ch: str) -> bool:
        if not self._tag.done:
            return self._tag.feed(ch)
        if self._call is None:
            if is_space(ch):
                return True
            self._call = CallObjectReader(self._sink, ARGUMENT_KEYS, eager=True)
            return self._call.feed(ch)
        if not self._call.done:
            return self._call.feed(ch)
        if self._close is None:
            if is_space(ch):
                return True
            self._close = Literal(CLOSE)
        if not self._close.feed(ch):
            return False
        self.closed = self._close.done
        return True


class HermesParser(ToolCallParser):
    name = "hermes"
    start_markers = (OPEN,)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return OPEN in chat_template and CLOSE in chat_template

    def region_reader(self, marker: str, sink: CallSink) -> RegionReader:
        return HermesReader(sink)

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
