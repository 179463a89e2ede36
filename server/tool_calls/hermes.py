"""Hermes-style tool calls (Hermes 2 Pro, Qwen2.5, Qwen3): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, after any text.
A region may end right after the object (a model may stop before the closing tag).

Small models often leave the tags out: Qwen2.5-0.5B-Instruct answers "What is the weather in
Paris? Use the tool." with the bare `{"name": "get_weather", "arguments": {"city": "Paris"}}`
(transformers' greedy output alike). So when the parser knows the request's tools, a reply
that starts with such an object is read as calls too (`UntaggedReader`), but only in the exact
shape of the format, naming one of those tools, and only once the object is complete: JSON
text that is anything else is content, as written.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .base import ToolCallParser
from .grammar import call_rules, tag
from .readers import (
    CallObjectReader,
    CallSink,
    Literal,
    OfferedCallReader,
    RegionReader,
    is_space,
)

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


class UntaggedReader(RegionReader):
    """Calls whose `<tool_call>` the model left out, at the start of the reply: offered call
    objects (`OfferedCallReader`), each optionally followed by its `</tool_call>`, separated
    by spaces; a tagged call may follow them (read as `HermesReader` reads it)."""

    def __init__(self, sink: CallSink, names: frozenset[str]) -> None:
        self._sink = sink
        self._names = names
        self._call: OfferedCallReader | None = None
        self._tag: str | None = None  # a tag being read after a call
        self._after_close = False  # the last call's `</tool_call>` was read
        self._tagged: HermesReader | None = None

    @property
    def complete(self) -> bool:
        if self._tagged is not None:
            return self._tagged.complete
        return self._call is not None and self._call.done and self._tag is None

    def feed(self, ch: str) -> bool:
        if self._tagged is not None:
            ok = self._tagged.feed(ch)
            self.closed = self._tagged.closed
            return ok
        if self._call is not None and not self._call.done:
            return self._call.feed(ch)
        if self._tag is not None:
            return self._tag_char(ch)
        if is_space(ch):
            return True
        if ch == "<" and not self._after_close:
            self._tag = ""
            return self._tag_char(ch)
        # After a closing tag anything but a call object ends the region there (the stream
        # reads a `<tool_call>` that follows as a region of its own).
        self._call = OfferedCallReader(self._sink, ARGUMENT_KEYS, self._names)
        self._after_close = False
        return self._call.feed(ch)

    def _tag_char(self, ch: str) -> bool:
        """A character of a tag right after a call object: its closing tag, or the next call's
        opening tag (the rest of the region is then that tagged call)."""
        assert self._tag is not None
        tag = self._tag = self._tag + ch
        if tag == OPEN:
            self._tag, self._tagged = None, HermesReader(self._sink)
            return all(self._tagged.feed(c) for c in OPEN)
        if tag == CLOSE:
            self._tag, self._after_close = None, True
            return True
        return OPEN.startswith(tag) or CLOSE.startswith(tag)


class HermesParser(ToolCallParser):
    name = "hermes"
    start_markers = (OPEN,)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return OPEN in chat_template and CLOSE in chat_template

    @property
    def leading_markers(self) -> tuple[str, ...]:
        """A bare call object counts only at the start, and only with the request's tools."""
        return ("{",) if self.tool_names else ()

    def region_reader(self, marker: str, sink: CallSink) -> RegionReader:
        if marker == OPEN:
            return HermesReader(sink)
        return UntaggedReader(sink, self.tool_names)

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
