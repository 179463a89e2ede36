"""The shapes tool-call parsing produces: a finished `ToolCall`, the `ToolCallDelta` pieces a
stream sends, `StreamDelta` (content and call pieces in the order written) and `collect`, which
folds added-up deltas into the non-streaming `(content, calls)`."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """Content and tool-call pieces in the order the model wrote them."""

    parts: list[str | ToolCallDelta] = field(default_factory=list)

    @property
    def content(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def tool_calls(self) -> list[ToolCallDelta]:
        return [p for p in self.parts if isinstance(p, ToolCallDelta)]

    def add(self, part: str | ToolCallDelta) -> None:
        """Append a piece; text joins text before it, and arguments the arguments before them."""
        last = self.parts[-1] if self.parts else None
        if isinstance(part, str):
            if not part:
                return
            if isinstance(last, str):
                self.parts[-1] = last + part
                return
        elif isinstance(last, ToolCallDelta) and last.index == part.index and last.id is None:
            # Arguments join arguments; a call's first piece (id and name) stays on its own.
            self.parts[-1] = ToolCallDelta(last.index, arguments=last.arguments + part.arguments)
            return
        self.parts.append(part)

    def __iadd__(self, other: StreamDelta) -> StreamDelta:
        for part in other.parts:
            self.add(part)
        return self


def collect(delta: StreamDelta) -> tuple[str | None, list[ToolCall]]:
    """Fold stream deltas (added up) into `(content, calls)`, the non-streaming shape."""
    calls: dict[int, ToolCall] = {}
    for d in delta.tool_calls:
        call = calls.setdefault(d.index, ToolCall(id="", name="", arguments=""))
        call.id = d.id or call.id
        call.name = d.name or call.name
        call.arguments += d.arguments
    out = [calls[i] for i in sorted(calls)]
    content = delta.content
    return (None if out and not content else content), out
