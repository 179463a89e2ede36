"""What every tool-call format shares: the parser interface, the readers that find calls in a
region a character at a time, and one incremental scanner that all formats run, streaming or
not.

A format says where a tool-call *region* starts (a marker anywhere in the output, such as
`<tool_call>`, or one that only counts at the very start, such as Llama's bare `{`) and how to
read a region (`ToolCallParser.region_reader`). `ToolCallStream` finds the regions as text
arrives: text outside them is content, released as soon as it cannot be the start of a
marker; a region's text goes to its reader a character at a time, and the reader reports
calls as it sees them:

- A call *starts* once its name is known: as soon as the `"name"` value is complete when the
  region began with a tag of the format (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`);
  when it began with bare JSON (`{`, `[`), only once the arguments value has begun too (or
  the object ended), since plain JSON text may hold a `"name"` key. The stream then sends
  the call's first delta: `index`, `id`, `name` and empty arguments.
- The arguments come as they arrive, in pieces: the model's own JSON text for the arguments
  object, from its `{` to its `}` (whitespace and escapes as written; arguments written as a
  JSON string holding an object are that string's decoded text). Each character is checked
  (`JsonScanner`) before it is sent, so what was sent is always the start of well-formed
  JSON. A call without arguments gets `{}`.

Malformed output. Until a call has started, nothing of it is sent: a region that goes wrong
(or ends) before then is plain content, as the model wrote it. Once a call has started it
cannot be taken back, so: at the first character that cannot continue a well-formed call
(or at the end of the output, e.g. when cut by max_tokens), the call ends with the arguments
sent so far (then not valid JSON, as in OpenAI's API when a call is cut off), the text of the
call's JSON before that character is dropped, and the output from that character on is
content, scanned for further calls as usual. Calls that completed before stay; after the last
of them, text that could only close the region (a list's `]`, spaces) is dropped and any other
text of the region is content. A forced call (`tool_choice` required or named) is written
under a grammar, so it is always well-formed.

`parse(text)` is the same scanner fed the whole text at once, so a stream reassembles to
exactly the non-streaming result however the text is split.

Whitespace on the edges of content is not worth a client's attention next to tool calls: a
trailing run of whitespace is held until more content follows, and dropped at the end when
the output made calls.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from .json_stream import JsonScanner


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


class CallSink(Protocol):
    """Where a region reader reports the calls it reads."""

    def start(self, name: str) -> None: ...

    def arguments(self, text: str) -> None: ...

    def end(self) -> None: ...


class RegionReader(ABC):
    """Reads one tool-call region, markers included, a character at a time."""

    closed: bool = False  # the region's end marker was read: what follows is content again

    @property
    @abstractmethod
    def complete(self) -> bool:
        """Whether the region may end here: between calls, after at least one."""

    @abstractmethod
    def feed(self, ch: str) -> bool:
        """Read `ch`; False when it cannot continue a well-formed region."""


def is_space(ch: str) -> bool:
    return ch.isspace()


class Literal:
    """Matches a fixed text (a tag) a character at a time."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    @property
    def done(self) -> bool:
        return self.pos == len(self.text)

    def feed(self, ch: str) -> bool:
        if self.done or self.text[self.pos] != ch:
            return False
        self.pos += 1
        return True


class ArgumentsReader:
    """A call's arguments object, passed on to the sink as it is read."""

    def __init__(self, sink: CallSink) -> None:
        self._sink = sink
        self._json = JsonScanner()

    @property
    def done(self) -> bool:
        return self._json.done

    def feed(self, ch: str) -> bool:
        if self._json.depth == 0 and ch != "{" or not self._json.feed(ch):
            return False
        self._sink.arguments(ch)
        return True


class CallObjectReader:
    """One call written as a JSON object, `{"name": ..., "<arguments key>": {...}}`, its keys
    in any order. Keys other than the name and the first arguments key are read and ignored
    (as are repeats of those). With `eager` the call starts as soon as its name is complete;
    otherwise once the arguments value has begun too, or the object has ended."""

    def __init__(self, sink: CallSink, argument_keys: tuple[str, ...], eager: bool) -> None:
        self._sink = sink
        self._keys = argument_keys
        self._eager = eager
        self._json = JsonScanner()
        self._key = ""
        self._role: str | None = None  # of the member value being read: name, object, ...
        self._name: str | None = None
        self._has_args = False
        self._started = False
        self._pending: list[str] = []  # arguments read before the call started
        self._inner: JsonScanner | None = None  # arguments written as a JSON string
        self.done = False

    def feed(self, ch: str) -> bool:
        j = self._json
        role = self._role
        if j.depth == 0 and ch != "{" or not j.feed(ch):
            return False
        if role == "string" and j.decoded and not self._string_arguments(j.decoded):
            return False
        emit = role == "object"
        for kind, depth in j.events:
            if depth == 1 and kind == "key":
                self._key = j.key
                continue
            if depth == 1 and kind == "start":
                ok = self._member(ch)
                emit = emit or self._role == "object"
            elif kind == "end":
                ok = self._member_done() if depth == 1 else depth > 1 or self._object_done()
            else:
                ok = True
            if not ok:
                return False
        if emit:
            self._arguments(ch)
        return True

    def _member(self, ch: str) -> bool:
        """A member value begins with `ch`: what is it?"""
        if self._key == "name" and self._name is None:
            self._role = "name"
            return ch == '"'
        if self._key in self._keys and not self._has_args:
            self._has_args = True
            if ch == "{":
                self._role = "object"
            elif ch == '"':
                self._role, self._inner = "string", None
            else:
                return False
            self._maybe_start()
            return True
        self._role = "skip"
        return True

    def _member_done(self) -> bool:
        role, self._role = self._role, None
        if role == "name":
            self._name = self._json.string
            if not self._name:
                return False
            self._maybe_start()
        elif role == "string":
            return self._inner is not None and self._inner.done
        return True

    def _string_arguments(self, text: str) -> bool:
        """Decoded text of arguments written as a JSON string: an object, spaces around it."""
        for c in text:
            inner = self._inner
            if inner is None or inner.done:
                if is_space(c):
                    continue
                if inner is not None or c != "{":
                    return False
                inner = self._inner = JsonScanner()
            if not inner.feed(c):
                return False
            self._arguments(c)
        return True

    def _object_done(self) -> bool:
        if self._name is None:
            return False
        if not self._has_args:
            self._start()
            self._arguments("{}")
        self._sink.end()
        self.done = True
        return True

    def _arguments(self, text: str) -> None:
        if self._started:
            self._sink.arguments(text)
        else:
            self._pending.append(text)

    def _maybe_start(self) -> None:
        if self._name is not None and (self._eager or self._has_args):
            self._start()

    def _start(self) -> None:
        if self._started:
            return
        assert self._name is not None
        self._started = True
        self._sink.start(self._name)
        if self._pending:
            self._sink.arguments("".join(self._pending))
            self._pending = []


class CallListReader(RegionReader):
    """A JSON list of call objects, `[{...}, {...}]`, then only whitespace."""

    def __init__(self, sink: CallSink, argument_keys: tuple[str, ...], eager: bool) -> None:
        self._sink = sink
        self._keys = argument_keys
        self._eager = eager
        self._state = "open"
        self._call: CallObjectReader | None = None

    @property
    def complete(self) -> bool:
        return self._state in ("after", "end")

    def feed(self, ch: str) -> bool:
        state = self._state
        if state == "call":
            assert self._call is not None
            if not self._call.feed(ch):
                return False
            if self._call.done:
                self._state = "after"
            return True
        if state == "open":
            self._state = "first"
            return ch == "["
        if is_space(ch):
            return True
        if state in ("first", "next") and ch == "{":
            self._call = CallObjectReader(self._sink, self._keys, self._eager)
            self._state = "call"
            return self._call.feed(ch)
        if state == "after" and ch in ",]":
            self._state = "next" if ch == "," else "end"
            return True
        return False


class ToolCallParser(ABC):
    """One model family's tool-call format. Subclasses set the markers and `region_reader`."""

    name: ClassVar[str]
    # Region starts: anywhere in the output, or only where the output starts (after spaces).
    start_markers: ClassVar[tuple[str, ...]] = ()
    leading_markers: ClassVar[tuple[str, ...]] = ()

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
        self._buf = ""  # content text not yet classified
        self._reader: RegionReader | None = None  # the open region's
        self._held: list[str] = []  # region text read since the last call started or ended
        self._commits = 0  # calls started or ended so far
        self._call: int | None = None  # the index of the call being read, while one is
        self._held_ws = ""  # trailing whitespace of the content so far
        self._started = False  # any non-whitespace content or region seen
        self._calls = 0  # calls started, sent or not
        self._out = StreamDelta()
        self._args: list[str] = []  # arguments text not yet added to `_out`
        self._args_index = 0  # ... of this call
        self._done = False

    # -- content and calls (the reader's sink) -----------------------------------------------

    def _add(self, part: str | ToolCallDelta) -> None:
        if self._args:  # arguments come a character at a time: joined once here
            args, self._args = "".join(self._args), []
            self._out.add(ToolCallDelta(self._args_index, arguments=args))
        self._out.add(part)

    def _content(self, text: str) -> None:
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        if body:
            self._started = True
            self._add(body)

    def _sent(self, index: int) -> bool:
        return self.max_calls is None or index < self.max_calls

    def start(self, name: str) -> None:
        index = self._call = self._calls
        self._calls += 1
        self._commits += 1
        self._held = []
        if self._sent(index):
            self._add(ToolCallDelta(index, id=self.parser.new_call_id(), name=name))

    def arguments(self, text: str) -> None:
        assert self._call is not None
        if self._sent(self._call):
            self._args_index = self._call
            self._args.append(text)

    def end(self) -> None:
        self._call = None
        self._commits += 1
        self._held = []

    def _region_failed(self, complete: bool) -> None:
        """The open region cannot go on: close it (see the module's note on malformed output).
        `complete`: it could have ended where it stopped (what was held is closing syntax)."""
        held, self._held, self._reader = "".join(self._held), [], None
        if self._call is not None:
            self.end()  # a started call ends as it stands; its text read since is dropped
        elif not complete:
            self._content(held)

    # -- scanning ----------------------------------------------------------------------------

    def _find_start(self) -> tuple[int, str] | None:
        """(where a region starts in the buffer, its marker), or None."""
        hits = [(self._buf.find(m), m) for m in self.parser.start_markers]
        hits = [h for h in hits if h[0] >= 0]
        if not self._started:
            lead = len(self._buf) - len(self._buf.lstrip())
            for m in self.parser.leading_markers:
                if self._buf.startswith(m, lead):
                    hits.append((lead, m))
        return min(hits, key=lambda h: (h[0], -len(h[1]))) if hits else None

    def _held_back(self) -> int:
        """How much of the buffer's end could still become a region start."""
        held = _partial_suffix(self._buf, self.parser.start_markers)
        if not self._started and self.parser.leading_markers:
            rest = self._buf.lstrip()
            if any(m.startswith(rest) for m in self.parser.leading_markers):
                held = max(held, len(rest))
        return held

    def _read(self, text: str) -> str:
        """Feed the open region's reader; the text left when the region closed or failed."""
        reader = self._reader
        assert reader is not None
        for i, ch in enumerate(text):
            commits, complete = self._commits, reader.complete
            if not reader.feed(ch):
                self._region_failed(complete)
                return text[i:]
            if commits == self._commits:  # a start or end consumes the text read so far
                self._held.append(ch)
            if reader.closed:
                self._held, self._reader = [], None
                return text[i + 1 :]
        return ""

    def feed(self, text: str) -> StreamDelta:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._out = out = StreamDelta()
        self._buf += text
        while self._buf:
            if self._reader is not None:
                self._buf = self._read(self._buf)
                continue
            start = self._find_start()
            if start is None:
                keep = self._held_back()
                self._content(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            pos, marker = start
            self._content(self._buf[:pos])
            self._started = True
            self._buf = self._buf[pos:]
            self._reader = self.parser.region_reader(marker, self)
        self._add("")
        return out

    def finish(self) -> StreamDelta:
        """The end of the output: an open region ends as if malformed here (a call being read
        ends with its arguments so far; a region before its first call is content); leftover
        text is content."""
        self._out = out = StreamDelta()
        if self._done:
            return out
        self._done = True
        if self._reader is not None:
            self._region_failed(self._reader.complete)
        if self._buf:
            self._content(self._buf)
            self._buf = ""
        self._add(self._held_ws if not self.num_calls else "")
        self._held_ws = ""
        return out

    @property
    def num_calls(self) -> int:
        """How many calls were sent."""
        return self._calls if self.max_calls is None else min(self._calls, self.max_calls)
