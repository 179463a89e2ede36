"""Mistral tool calls: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects
(v3 tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` per call (v11+). `[TOOL_CALLS]` is a
special token, which a detokenizer that skips special tokens drops: an answer that starts
with a JSON list of objects is read as calls too. Mistral's templates insist on call ids of
nine letters and digits, so this format makes those.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Collection
from typing import Any

from .base import ToolCallParser
from .grammar import call_rules
from .readers import (
    ArgumentsReader,
    CallListReader,
    CallSink,
    Literal,
    RegionReader,
    is_space,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
_ID_CHARS = string.ascii_letters + string.digits
ARGUMENT_KEYS = ("arguments", "parameters")


class MistralReader(RegionReader):
    """`[TOOL_CALLS]` and a list of call objects, or `[TOOL_CALLS]name[ARGS]{...}` repeated;
    or, untagged (the special token dropped), a list alone, whose calls start once their
    arguments begin."""

    def __init__(self, sink: CallSink, tagged: bool) -> None:
        self._sink = sink
        self._tagged = tagged
        self._literal = Literal(TOOL_CALLS) if tagged else None
        self._state = "body" if tagged else "list"
        self._list = None if tagged else CallListReader(sink, ARGUMENT_KEYS, eager=False)
        self._name: list[str] = []
        self._args: ArgumentsReader | None = None

    @property
    def complete(self) -> bool:
        if self._state == "list":
            return self._list is not None and self._list.complete
        return self._state == "after"

    def feed(self, ch: str) -> bool:
        if self._literal is not None:  # a tag being read
            if not self._literal.feed(ch):
                return False
            if self._literal.done:
                self._literal = None
                if self._state == "args_tag":
                    self._sink.start("".join(self._name))
                    self._state = "args"
            return True
        state = self._state
        if state == "list":
            assert self._list is not None
            return self._list.feed(ch)
        if state == "args" and self._args is not None:
            if not self._args.feed(ch):
                return False
            if self._args.done:
                self._sink.end()
                self._state, self._args = "after", None
            return True
        if is_space(ch):
            if state == "name":
                self._state = "name_end"
            return True
        if state in ("body", "next") and ch in _NAME_CHARS:
            self._state, self._name = "name", [ch]
            return True
        if state == "body" and ch == "[":  # v3: a list of call objects
            self._state = "list"
            self._list = CallListReader(self._sink, ARGUMENT_KEYS, eager=True)
            return self._list.feed(ch)
        if state == "name" and ch in _NAME_CHARS:
            self._name.append(ch)
            return True
        if state in ("name", "name_end") and ch == "[":
            self._state, self._literal = "args_tag", Literal(ARGS)
            return self._literal.feed(ch)
        if state == "args":
            self._args = ArgumentsReader(self._sink)
            return self._args.feed(ch)
        if state == "after" and ch == "[":
            self._state, self._literal = "next", Literal(TOOL_CALLS)
            return self._literal.feed(ch)
        return False


class MistralParser(ToolCallParser):
    name = "mistral"
    start_markers = (TOOL_CALLS,)
    leading_markers = ("[{",)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return TOOL_CALLS in chat_template

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def region_reader(self, marker: str, sink: CallSink) -> RegionReader:
        return MistralReader(sink, tagged=marker == TOOL_CALLS)

    def forced_call_grammar(
        self,
        tools: list[dict[str, Any]],
        tool_choice: str | dict[str, Any],
        parallel: bool = True,
        added_tokens: Collection[str] = (),
    ) -> str:
        # The JSON list without the `[TOOL_CALLS]` token: a grammar cannot name a special token
        # whose name lacks angle brackets, and the list alone is read as calls.
        more = ' (", " call)*' if parallel else ""
        return f'start: "[" call{more} "]"\n' + call_rules(tools, tool_choice, "arguments")
