"""Checking JSON text as it arrives, one character at a time.

`JsonScanner` accepts exactly RFC 8259 JSON (no `NaN`, no control characters inside strings,
no trailing commas) and says, for each character, whether it can still be part of a
well-formed value. Besides yes or no it reports what the character did (a value started or
ended, a key ended, with the depth it happened at) and the text a string gained (escapes
decoded), which is what the tool-call readers need to find a call's name and its arguments
while the model is still writing them.
"""

from __future__ import annotations

_WS = " \t\n\r"
_DIGITS = "0123456789"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}

# Number states: after a sign, a leading zero, integer digits, a dot, fraction digits, an `e`,
# an exponent sign, exponent digits. A number may end in the states of _NUMBER_ENDS.
_NUMBER_ENDS = ("zero", "int", "frac", "exp")


def _number_step(state: str, ch: str) -> str | None:
    """The number state after `ch`, or None when `ch` is not part of the number."""
    digit = ch in _DIGITS
    if state == "sign":
        return "zero" if ch == "0" else "int" if digit else None
    if state in ("zero", "int", "frac"):
        if digit and state != "zero":
            return state
        if ch == "." and state != "frac":
            return "dot"
        return "e" if ch in "eE" else None
    if state == "dot":
        return "frac" if digit else None
    if state == "e":
        return "esign" if ch in "+-" else "exp" if digit else None
    return "exp" if digit else None  # "esign", "exp"


class JsonScanner:
    """One JSON value, fed a character at a time.

    `feed(ch)` is False when `ch` cannot continue the text (the scanner is then left as it was
    before, apart from a number that `ch` would have ended). After each fed character:
    `events` lists `("start", depth)` (a value began with it), `("end", depth)` (a value ended:
    with it, or just before it for a number), `("key", depth)` (an object key ended with it;
    `key` holds the key); the depth is the number of containers around the value (0 for the
    top-level value, 1 for a member of the top-level object). `decoded` is the text `ch` added
    to the string being read, `string` the whole of the last string that ended. `done` is set
    once the top-level value is complete; nothing more is accepted after that.
    """

    def __init__(self) -> None:
        self._stack: list[str] = []  # "{" or "[" per open container
        self._state = "value"
        self._literal = ""  # the rest of a true/false/null being read
        self._hex = ""  # the digits of a \u escape so far
        self._high = ""  # a high surrogate waiting for its low half
        self._chars: list[str] = []  # the string being read, decoded
        self._is_key = False
        self.done = False
        self.events: list[tuple[str, int]] = []
        self.decoded = ""
        self.string = ""
        self.key = ""

    @property
    def depth(self) -> int:
        return len(self._stack)

    # -- values --------------------------------------------------------------------------------

    def _end_value(self) -> None:
        self.events.append(("end", len(self._stack)))
        if self._stack:
            self._state = "after"
        else:
            self.done = True

    def _start_value(self, ch: str) -> bool:
        if ch in "{[":
            self.events.append(("start", len(self._stack)))
            self._stack.append(ch)
            self._state = "first_key" if ch == "{" else "first_item"
        elif ch == '"':
            self.events.append(("start", len(self._stack)))
            self._open_string(is_key=False)
        elif ch == "-" or ch in _DIGITS:
            self.events.append(("start", len(self._stack)))
            self._state = "sign" if ch == "-" else "zero" if ch == "0" else "int"
        elif ch in _LITERALS:
            self.events.append(("start", len(self._stack)))
            self._state, self._literal = "literal", _LITERALS[ch]
        else:
            return False
        return True

    # -- strings -------------------------------------------------------------------------------

    def _open_string(self, is_key: bool) -> None:
        self._state, self._is_key, self._chars = "string", is_key, []

    def _add(self, text: str) -> None:
        if self._high:  # a high surrogate not followed by its low half stays as it is
            text, self._high = self._high + text, ""
        self._chars.append(text)
        self.decoded += text

    def _close_string(self) -> None:
        self._add("")
        text = "".join(self._chars)
        if self._is_key:
            self.key = text
            self.events.append(("key", len(self._stack)))
            self._state = "colon"
        else:
            self.string = text
            self._end_value()

    def _string_char(self, ch: str) -> bool:
        state = self._state
        if state == "string":
            if ch == '"':
                self._close_string()
            elif ch == "\\":
                self._state = "escape"
            elif ch < " ":
                return False
            else:
                self._add(ch)
        elif state == "escape":
            if ch == "u":
                self._state, self._hex = "unicode", ""
            elif ch in _ESCAPES:
                self._state = "string"
                self._add(_ESCAPES[ch])
            else:
                return False
        else:  # "unicode"
            if ch not in "0123456789abcdefABCDEF":
                return False
            self._hex += ch
            if len(self._hex) == 4:
                self._state = "string"
                code = int(self._hex, 16)
                if 0xD800 <= code < 0xDC00:
                    self._add("")
                    self._high = chr(code)
                elif 0xDC00 <= code < 0xE000 and self._high:
                    high, self._high = ord(self._high), ""
                    self._add(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
                else:
                    self._add(chr(code))
        return True

    # -- feeding -------------------------------------------------------------------------------

    def feed(self, ch: str) -> bool:
        self.events = []
        self.decoded = ""
        if self.done:
            return False
        state = self._state
        if state in ("string", "escape", "unicode"):
            return self._string_char(ch)
        if state == "literal":
            if ch != self._literal[0]:
                return False
            self._literal = self._literal[1:]
            if not self._literal:
                self._end_value()
            return True
        if state in ("sign", "zero", "int", "dot", "frac", "e", "esign", "exp"):
            step = _number_step(state, ch)
            if step is not None:
                self._state = step
                return True
            if state not in _NUMBER_ENDS:
                return False
            self._end_value()  # the number ended before `ch`, which goes on below
            if self.done:
                return False
            state = self._state
        if ch in _WS:
            return True
        if state in ("value", "first_item"):
            if state == "first_item" and ch == "]":
                return self._close_container()
            return self._start_value(ch)
        if state in ("first_key", "key"):
            if ch == '"':
                self._open_string(is_key=True)
                return True
            return state == "first_key" and ch == "}" and self._close_container()
        if state == "colon":
            if ch != ":":
                return False
            self._state = "value"
            return True
        # "after": a value ended inside a container
        if ch == ",":
            self._state = "key" if self._stack[-1] == "{" else "value"
            return True
        if ch in "}]" and "{[".index(self._stack[-1]) == "}]".index(ch):
            return self._close_container()
        return False

    def _close_container(self) -> bool:
        self._stack.pop()
        self._end_value()
        return True
