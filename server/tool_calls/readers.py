"""Region readers: what reads one tool-call region a character at a time and reports the calls
it finds to a `CallSink` (see `stream.py` for how regions are found and what is sent when).
Formats build their `RegionReader` from these pieces: tags (`Literal`), call objects
(`CallObjectReader`; `OfferedCallReader` for one that only the request's tools tell from
text), lists of them (`CallListReader`) and bare arguments (`ArgumentsReader`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from .json_stream import JsonScanner


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


class _HeldCall:
    """A `CallSink` that keeps one call's reports for later."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments_text: list[str] = []

    def start(self, name: str) -> None:
        self.name = name

    def arguments(self, text: str) -> None:
        self.arguments_text.append(text)

    def end(self) -> None:
        pass

    def replay(self, sink: CallSink) -> None:
        assert self.name is not None
        sink.start(self.name)
        sink.arguments("".join(self.arguments_text))
        sink.end()


class OfferedCallReader(CallObjectReader):
    """A call written as bare JSON where plain text may stand too (no tag says it is a call):
    exactly `{"name": N, "<arguments key>": {...}}`, those two members in that order, N one of
    the request's tool names. Reported to the sink only once the object is complete, so text
    that turns out not to be such a call was never sent as one and stays content as written.
    It fails at the first character that cannot begin such an object: a key other than the
    expected one, or a name that no offered name begins with (`{"answer"` at its `a`)."""

    def __init__(
        self, sink: CallSink, argument_keys: tuple[str, ...], names: frozenset[str]
    ) -> None:
        self._held = _HeldCall()
        super().__init__(self._held, argument_keys, eager=True)
        self._target = sink
        self._names = names
        self._members = 0  # member values begun
        self._text = ""  # the key, or the name, read so far (decoded)

    def _expected_keys(self) -> tuple[str, ...]:
        return ("name",) if self._members == 0 else self._keys if self._members == 1 else ()

    def feed(self, ch: str) -> bool:
        reading = self._role  # None: a key (or the space around it); "name": the name
        if not super().feed(ch):
            return False
        decoded = self._json.decoded
        if decoded and reading in (None, "name"):
            self._text += decoded
            allowed = self._names if reading == "name" else self._expected_keys()
            if not any(a.startswith(self._text) for a in allowed):
                return False
        if self.done:
            self._held.replay(self._target)
        return True

    def _member(self, ch: str) -> bool:
        expected = self._expected_keys()
        self._members += 1
        self._text = ""
        if self._key not in expected or (self._key != "name" and ch != "{"):
            return False
        return super()._member(ch)

    def _member_done(self) -> bool:
        was_name, self._text = self._role == "name", ""
        if not super()._member_done():
            return False
        return not was_name or self._name in self._names

    def _object_done(self) -> bool:
        return self._has_args and super()._object_done()
