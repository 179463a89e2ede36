"""What every tool-call format shares: the parser interface, and one incremental scanner that
all formats run, streaming or not.

A format says where a tool-call *region* starts (a marker anywhere in the output, such as
`<tool_call>`, or one that only counts at the very start, such as Llama's bare `{`), where it
ends (a closing marker, or the end of the output), and how a region's text becomes calls.
`ToolCallStream` finds the regions as text arrives: text outside them is content, released as
soon as it cannot be the start of a marker; a region is held until it is complete, then
released as tool-call deltas if it parses, or as plain content if it does not. Holding the
region is what keeps the promise that malformed JSON is plain content in a stream too, since a
streamed tool-call delta cannot be taken back.

`parse(text)` is the same scanner fed the whole text at once, so a stream reassembles to
exactly the non-streaming result however the text is split.

Whitespace on the edges of content is not worth a client's attention next to tool calls: a
trailing run of whitespace is held until more content follows, and dropped at the end when
the output made calls.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCallDelta:
    """A piece of call `index`: `id` and `name` in its first piece, then `arguments` text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: StreamDelta) -> StreamDelta:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


def arguments_json(value: Any) -> str | None:
    """A call's arguments as the JSON object text clients get, or None if they are not an
    object (a JSON string holding an object is accepted, as some models write that)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj: Any, *argument_keys: str) -> tuple[str, str] | None:
    """`(name, arguments)` from a `{"name": ..., "<argument key>": {...}}` object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in argument_keys:
        if key in obj:
            args = arguments_json(obj[key])
            return None if args is None else (obj["name"], args)
    return obj["name"], "{}"  # a call without arguments


def json_values(text: str, separators: str = "") -> list[Any] | None:
    """Consecutive JSON values in `text`, separated by whitespace and any of `separators`;
    None if anything else is there."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or (values and text[pos] in separators)):
            pos += 1
        if pos == len(text):
            return values or None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


class ToolCallParser(ABC):
    """One model family's tool-call format. Subclasses set the markers and `parse_region`."""

    name: ClassVar[str]
    # Region starts: anywhere in the output, or only where the output starts (after spaces).
    start_markers: ClassVar[tuple[str, ...]] = ()
    leading_markers: ClassVar[tuple[str, ...]] = ()
    # Where a region ends (the marker is part of it); None: at the end of the output.
    end_marker: ClassVar[str | None] = None

    @classmethod
    @abstractmethod
    def matches(cls, chat_template: str) -> bool:
        """Whether a model with this chat template writes tool calls in this format."""

    @abstractmethod
    def parse_region(self, region: str) -> list[tuple[str, str]] | None:
        """A region's text (markers included) as `(name, arguments JSON)` pairs, or None when
        it is not well-formed (its text is then plain content)."""

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


def collect(delta: StreamDelta) -> tuple[str | None, list[ToolCall]]:
    """Fold stream deltas (added up) into `(content, calls)`, the non-streaming shape."""
    calls: dict[int, ToolCall] = {}
    for d in delta.tool_calls:
        call = calls.setdefault(d.index, ToolCall(id="", name="", arguments=""))
        call.id = d.id or call.id
        call.name = d.name or call.name
        call.arguments += d.arguments
    out = [calls[i] for i in sorted(calls)]
    return (None if out and not delta.content else delta.content), out


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class ToolCallStream:
    """Feed a completion's text in pieces; each call returns what can be released so far."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self._buf = ""  # text not yet classified
        self._region: str | None = None  # the open region's text, markers included
        self._held_ws = ""  # trailing whitespace of the content so far
        self._started = False  # any non-whitespace content or region seen
        self._calls = 0
        self._done = False

    # -- content and calls -------------------------------------------------------------------

    def _content(self, text: str, out: StreamDelta) -> None:
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        if body:
            self._started = True
            out.content += body

    def _region_done(self, region: str, out: StreamDelta) -> None:
        calls = self.parser.parse_region(region)
        if calls is None:
            self._content(region, out)
            return
        for name, args in calls:
            if self.max_calls is not None and self._calls >= self.max_calls:
                break
            index = self._calls
            self._calls += 1
            call_id = self.parser.new_call_id()
            out.tool_calls.append(ToolCallDelta(index, id=call_id, name=name))
            out.tool_calls.append(ToolCallDelta(index, arguments=args))

    # -- scanning ----------------------------------------------------------------------------

    def _find_start(self) -> tuple[int, int] | None:
        """(where a region starts in the buffer, marker length), or None."""
        hits = [(self._buf.find(m), len(m)) for m in self.parser.start_markers]
        hits = [h for h in hits if h[0] >= 0]
        if not self._started:
            lead = len(self._buf) - len(self._buf.lstrip())
            for m in self.parser.leading_markers:
                if self._buf.startswith(m, lead):
                    hits.append((lead, len(m)))
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """How much of the buffer's end could still become a region start."""
        held = _partial_suffix(self._buf, self.parser.start_markers)
        if not self._started and self.parser.leading_markers:
            rest = self._buf.lstrip()
            if any(m.startswith(rest) for m in self.parser.leading_markers):
                held = max(held, len(rest))
        return held

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        while self._buf:
            if self._region is None:
                start = self._find_start()
                if start is None:
                    keep = self._held_back()
                    self._content(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                pos, _ = start
                self._content(self._buf[:pos], out)
                self._started = True
                self._region, self._buf = "", self._buf[pos:]
                # The start marker is consumed with the region below.
            end = self.parser.end_marker
            if end is None:  # the region runs to the end of the output
                self._region += self._buf
                self._buf = ""
                break
            # The end marker is searched for past the start marker only.
            region = self._region + self._buf
            start_len = self._start_len(region)
            at = region.find(end, start_len)
            if at < 0:
                self._region, self._buf = region, ""
                break
            stop = at + len(end)
            self._region = None
            self._region_done(region[:stop], out)
            self._buf = region[stop:]
        return out

    def _start_len(self, region: str) -> int:
        for m in (*self.parser.start_markers, *self.parser.leading_markers):
            if region.startswith(m):
                return len(m)
        return 0

    def finish(self) -> StreamDelta:
        """What is left at the end of the output: an unclosed region is parsed as it stands
        (a model may stop right after a call's JSON), leftover text is content."""
        out = StreamDelta()
        if self._done:
            return out
        self._done = True
        if self._region is not None:
            region, self._region = self._region + self._buf, None
            self._buf = ""
            self._region_done(region, out)
        if self._buf:
            self._content(self._buf, out)
            self._buf = ""
        if not self._calls:
            out.content += self._held_ws
        self._held_ws = ""
        return out

    @property
    def num_calls(self) -> int:
        return self._calls
