"""Llama 3.1-3.3 JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`, if the detokenizer keeps special tokens), several calls
separated by `;`. An answer that does not start with one is plain text.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .base import ToolCallParser
from .grammar import call_rules
from .readers import CallObjectReader, CallSink, Literal, RegionReader, is_space

PYTHON_TAG = "<|python_tag|>"


class Llama3Reader(RegionReader):
    """An optional `<|python_tag|>`, then call objects separated by spaces and `;`. After the
    tag a call starts with its name; after a bare `{` once its arguments begin."""

    def __init__(self, sink: CallSink, tagged: bool) -> None:
        self._sink = sink
        self._tag = Literal(PYTHON_TAG if tagged else "")
        self._eager = tagged
        self._call: CallObjectReader | None = None

    @property
    def complete(self) -> bool:
        return self._call is not None and self._call.done

    def feed(self, ch: str) -> bool:
        if not self._tag.done:
            return self._tag.feed(ch)
        if self._call is not None and not self._call.done:
            return self._call.feed(ch)
        if is_space(ch) or (ch == ";" and self._call is not None):
            return True
        self._call = CallObjectReader(self._sink, ("parameters", "arguments"), self._eager)
        return self._call.feed(ch)


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    leading_markers = (PYTHON_TAG, "{")

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return "<|start_header_id|>" in chat_template and (
            PYTHON_TAG in chat_template or '"parameters"' in chat_template
        )

    def region_reader(self, marker: str, sink: CallSink) -> RegionReader:
        return Llama3Reader(sink, tagged=marker == PYTHON_TAG)

    def forced_call_grammar(
        self,
        tools: list[dict[str, Any]],
        tool_choice: str | dict[str, Any],
        parallel: bool = True,
        added_tokens: Collection[str] = (),
    ) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\n" + call_rules(tools, tool_choice, "parameters")
