"""Mistral tool calls: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects
(v3 tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` per call (v11+). `[TOOL_CALLS]` is a
special token, which a detokenizer that skips special tokens drops: an answer that starts
with a JSON list of objects is read as calls too. Mistral's templates insist on call ids of
nine letters and digits, so this format makes those.
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Collection
from typing import Any

from .base import ToolCallParser, call_from_object, json_values
from .grammar import call_rules

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*$")
_ID_CHARS = string.ascii_letters + string.digits


class MistralParser(ToolCallParser):
    name = "mistral"
    start_markers = (TOOL_CALLS,)
    leading_markers = ("[{",)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return TOOL_CALLS in chat_template

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def parse_region(self, region: str) -> list[tuple[str, str]] | None:
        body = region.strip().removeprefix(TOOL_CALLS).strip()
        if body.startswith("["):
            values = json_values(body)
            if values is None or len(values) != 1 or not isinstance(values[0], list):
                return None
            calls = [call_from_object(v, "arguments", "parameters") for v in values[0]]
        else:
            calls = [self._named_call(part) for part in body.split(TOOL_CALLS)]
        if not calls or any(c is None for c in calls):
            return None
        return calls  # type: ignore[return-value]

    @staticmethod
    def _named_call(part: str) -> tuple[str, str] | None:
        name, sep, args = part.partition(ARGS)
        m = _NAME.match(name)
        values = json_values(args) if sep else None
        if m is None or values is None or len(values) != 1 or not isinstance(values[0], dict):
            return None
        return call_from_object({"name": m.group(1), "arguments": values[0]}, "arguments")

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
