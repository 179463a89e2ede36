"""Stop strings over streamed text: cut at the first stop, hold back what might start one.

Text arrives in pieces (one per detokenizer push), so a stop string can straddle pieces.  The
matcher keeps an unreleased tail: the longest suffix of the text seen so far that is a proper
prefix of some stop string.  Everything before that tail is safe to emit: a stop occurrence
starting earlier would make a longer suffix a prefix of a stop (so it would be held) or would
already be complete (so it would have matched).  Hence a search never needs to look further
back than the held tail plus the new piece.
"""

from __future__ import annotations

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    def __init__(self, stop: list[str]) -> None:
        # Empty stop strings would match everywhere; they carry no meaning, so drop them.
        self.stops = [s for s in dict.fromkeys(stop) if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation, if any

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string has matched).

        On a match the stop string and everything after it are dropped; later calls return
        ("", True).  Matching happens as soon as a piece completes any stop; if several stops
        are complete in the text so far, the cut is at the earliest start among them.
        """
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        cut, which = -1, None
        for s in self.stops:
            at = buf.find(s)
            if at >= 0 and (cut < 0 or at < cut or (at == cut and len(s) > len(which))):
                cut, which = at, s
        if cut >= 0:
            self._held = ""
            self.stopped = True
            self.matched = which
            return buf[:cut], True
        hold = self._longest_partial(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """End of generation: the held tail was never completed into a stop, so release it."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
