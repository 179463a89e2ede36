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
  the object ended), since plain JSON text may hold a `"name"` key. A reader may hold a call
  back longer: Hermes' untagged calls are sent only once their object is complete (see
  `OfferedCallReader`). The stream then sends the call's first delta: `index`, `id`, `name`
  and empty arguments.
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

from typing import TYPE_CHECKING

from .deltas import StreamDelta, ToolCallDelta
from .readers import RegionReader

if TYPE_CHECKING:
    from .base import ToolCallParser


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
