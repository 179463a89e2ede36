"""StopStringMatcher against a brute-force oracle over every way of splitting the text."""

from __future__ import annotations

import itertools
import random

import pytest

from tallow.runtime.stop_strings import StopStringMatcher


def _oracle_final(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """Generation stops after the first piece whose arrival makes the text contain a stop;
    the output is cut at the earliest start of any stop in the text up to that piece.  (So
    with stops "b" and "cbc", text "cb" + "c" stops at "b", as a real engine would, while a
    single piece "cbc" cuts at "c".)"""
    seen = ""
    for piece in pieces:
        seen += piece
        starts = [seen.find(s) for s in stops if s and s in seen]
        if starts:
            return seen[: min(starts)], True
    return seen, False


def _oracle_safe(seen: str, stops: list[str]) -> str:
    """Brute force: the longest prefix of `seen` such that no suffix after it could still
    begin a stop string."""
    for j in range(len(seen)):
        if any(s.startswith(seen[j:]) for s in stops if s):
            return seen[:j]
    return seen


def _splits(text: str):
    """Every way to cut `text` into consecutive non-empty pieces (2^(n-1) of them); for long
    texts a fixed random sample of them, to keep the test fast."""
    n = len(text)
    masks = range(1 << max(n - 1, 0))
    if n > 13:
        masks = random.Random(n).sample(masks, 3000)
    for mask in masks:
        cuts = [i + 1 for i in range(n - 1) if mask >> i & 1]
        bounds = [0, *cuts, n]
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


def _run(pieces: list[str], stops: list[str]) -> tuple[str, bool, list[tuple[str, bool]]]:
    m = StopStringMatcher(stops)
    steps = [m.feed(p) for p in pieces]
    out = "".join(t for t, _ in steps)
    stopped = any(hit for _, hit in steps)
    return out + m.flush(), stopped, steps


CASES = [
    ("hello world", ["wor"]),
    ("abcabd", ["abd"]),  # a false start that must be released, then a real match
    ("aaab", ["aab"]),  # self-overlapping stop
    ("xabcdx", ["bcd", "abc"]),  # overlapping stops: earliest start wins
    ("xbcdex", ["cde", "bcdf"]),  # a longer candidate fails, a shorter one matches
    ("stop here", ["stop"]),  # stop at the very start
    ("no match here", ["xyz", "hex"]),
    ("ends with partial st", ["stop"]),  # held tail released by flush
    ("日本語😀テキスト", ["😀テ"]),
    ("a\n\nb", ["\n\n"]),
    ("abc", ["abc"]),  # the whole text is the stop
    ("abababx", ["ababx", "bax"]),
    ("acccbcb", ["cbc", "b"]),  # a short stop inside a longer one: outcome depends on pieces
]


@pytest.mark.parametrize(("text", "stops"), CASES)
def test_every_split_matches_the_oracle(text, stops):
    for pieces in _splits(text):
        want, want_stop = _oracle_final(pieces, stops)
        out, stopped, steps = _run(pieces, stops)
        assert (out, stopped) == (want, want_stop), pieces
        # Released text is never more than safe, and never less than the oracle allows.
        seen, emitted = "", ""
        for piece, (t, hit) in zip(pieces, steps, strict=True):
            seen += piece
            emitted += t
            if hit:
                assert emitted == want
                break
            assert emitted == _oracle_safe(seen, stops), (pieces, seen)


def test_random_texts_and_splits():
    rng = random.Random(0)
    for _ in range(2000):
        alphabet = "abc"
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in "xy"]
        cuts = sorted(rng.sample(range(1, max(len(text), 1)), k=min(3, max(len(text) - 1, 0))))
        pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
        out, stopped, _ = _run(pieces, stops)
        assert (out, stopped) == _oracle_final(pieces, stops), (text, stops, pieces)
        if len(pieces) == 1 or not stopped:
            assert (out, stopped) == _oracle_final([text], stops)


def test_match_reports_once_and_ignores_later_text():
    m = StopStringMatcher(["END"])
    assert m.feed("abc E") == ("abc ", False)
    assert m.feed("NDxyz") == ("", True)
    assert m.matched == "END"
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_false_start_is_released_as_soon_as_it_fails():
    m = StopStringMatcher(["</answer>"])
    assert m.feed("x </ans") == ("x ", False)
    assert m.feed("wer? no") == ("</answer? no", False)
    assert m.flush() == ""


def test_no_stops_passes_everything_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False)
    m = StopStringMatcher([""])  # an empty stop string means nothing
    assert m.feed("anything") == ("anything", False)
    assert m.flush() == ""


def test_empty_pieces_are_harmless():
    m = StopStringMatcher(["ab"])
    assert m.feed("") == ("", False)
    assert m.feed("a") == ("", False)
    assert m.feed("") == ("", False)
    assert m.feed("b") == ("", True)
