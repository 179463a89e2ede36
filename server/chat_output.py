"""A chat completion's text, split into reasoning, content and tool calls.

`ChatOutputOptions` says, per request, what to look for (a reasoning block, a tool-call format);
`ChoiceStream` does it incrementally for one choice (reasoning first, then tool calls in what
is left), and `parse_choice` runs the same stream over a whole text, so a streamed response
reassembles to exactly the non-streamed one.
"""

from __future__ import annotations

from dataclasses import dataclass

from .reasoning import ReasoningStream
from .tool_calls import StreamDelta, ToolCall, ToolCallParser
from .tool_calls.deltas import collect


@dataclass(frozen=True)
class ChatOutputOptions:
    tool_parser: ToolCallParser | None = None  # None: tool calls are not looked for
    max_tool_calls: int | None = None  # 1 when parallel_tool_calls is false
    reasoning: bool = False  # the template has a think block
    reasoning_starts_inside: bool = False  # ... and the prompt left it open

    @property
    def plain(self) -> bool:
        return self.tool_parser is None and not self.reasoning


@dataclass
class ChoiceDelta(StreamDelta):
    """Reasoning (which comes before anything else), then content and tool-call pieces in
    the order written (`parts`; `content` and `tool_calls` as for `StreamDelta`)."""

    reasoning: str = ""

    def __iadd__(self, other: StreamDelta) -> ChoiceDelta:
        if isinstance(other, ChoiceDelta):
            self.reasoning += other.reasoning
        super().__iadd__(other)
        return self


class ChoiceStream:
    def __init__(self, options: ChatOutputOptions) -> None:
        self.options = options
        self._reasoning = (
            ReasoningStream(options.reasoning_starts_inside) if options.reasoning else None
        )
        self._tools = (
            options.tool_parser.stream(options.max_tool_calls) if options.tool_parser else None
        )

    @property
    def saw_reasoning(self) -> bool:
        return self._reasoning is not None and self._reasoning.saw_reasoning

    @property
    def made_tool_calls(self) -> bool:
        return self._tools is not None and self._tools.num_calls > 0

    def _content(self, text: str) -> ChoiceDelta:
        out = ChoiceDelta()
        if self._tools is None:
            out.add(text)
        else:
            out += self._tools.feed(text)
        return out

    def feed(self, text: str) -> ChoiceDelta:
        if self._reasoning is None:
            return self._content(text)
        r = self._reasoning.feed(text)
        out = self._content(r.content) if r.content else ChoiceDelta()
        out.reasoning = r.reasoning
        return out

    def finish(self) -> ChoiceDelta:
        out = ChoiceDelta()
        if self._reasoning is not None:
            r = self._reasoning.finish()
            out.reasoning = r.reasoning
            if r.content:
                out += self._content(r.content)
        if self._tools is not None:
            out += self._tools.finish()
        return out


@dataclass
class ParsedChoice:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


def parse_choice(options: ChatOutputOptions, text: str) -> ParsedChoice:
    stream = ChoiceStream(options)
    delta = stream.feed(text)
    delta += stream.finish()
    content, calls = collect(delta)
    if options.tool_parser is None:
        content = delta.content
    reasoning = delta.reasoning if stream.saw_reasoning else None
    return ParsedChoice(reasoning, content, calls)
