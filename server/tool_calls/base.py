"""The tool-call parser interface: one subclass per model family's format (markers, a region
reader and a forced-call grammar). The readers live in `readers.py`, the incremental scanner
every format runs (streaming or not) in `stream.py`, and the data it produces in `deltas.py`."""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any, ClassVar

from .deltas import ToolCall, collect
from .readers import CallSink, RegionReader
from .stream import ToolCallStream


class ToolCallParser(ABC):
    """One model family's tool-call format. Subclasses set the markers and `region_reader`."""

    name: ClassVar[str]
    # Region starts: anywhere in the output, or only where the output starts (after spaces;
    # these may depend on `tool_names`).
    start_markers: ClassVar[tuple[str, ...]] = ()
    leading_markers: tuple[str, ...] = ()

    def __init__(self, tool_names: Collection[str] = ()) -> None:
        # The request's tools: a format may then also read calls that it would not know from
        # text without them (Hermes: a call object whose tag the model left out).
        self.tool_names = frozenset(tool_names)

    @classmethod
    @abstractmethod
    def matches(cls, chat_template: str) -> bool:
        """Whether a model with this chat template writes tool calls in this format."""

    @abstractmethod
    def region_reader(self, marker: str, sink: CallSink) -> RegionReader:
        """A reader for a region that starts with `marker` (one of the start or leading
        markers; the reader is fed the marker too), reporting its calls to `sink`."""

    @abstractmethod
    def forced_call_grammar(
        self,
        tools: list[dict[str, Any]],
        tool_choice: str | dict[str, Any],
        parallel: bool = True,
        added_tokens: Collection[str] = (),
    ) -> str:
        """A Lark grammar (llguidance's dialect) that makes the model write tool calls in this
        format, their arguments following each tool's JSON schema. `tools` are OpenAI tool
        definitions; `tool_choice` is "required" (any of them) or `{"type": "function",
        "function": {"name": ...}}` (that one); `parallel` allows more than one call;
        `added_tokens` are the tokenizer's added tokens (tags among them are named as tokens)."""

    def new_call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    # -- shared ------------------------------------------------------------------------------

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        """An incremental parser for one completion; calls past `max_calls` are dropped."""
        return ToolCallStream(self, max_calls)

    def parse(self, text: str, max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
        """`(content, calls)` for a whole output; content is None when it is empty and the
        model made calls (OpenAI's shape). Never raises on odd model output."""
        stream = self.stream(max_calls)
        delta = stream.feed(text)
        delta += stream.finish()
        return collect(delta)
