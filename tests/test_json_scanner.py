"""The incremental JSON checker the tool-call parsers run (`tool_calls/json_stream.py`) agrees
with `json.loads`, on chosen and on random documents.
"""

from __future__ import annotations

import json
import random

import pytest

from tallow.server.tool_calls.json_stream import JsonScanner

# -- the incremental JSON checker --------------------------------------------------------------

JSON_GOOD = [
    '{"a": [1, -2.5, 3e10, 0.1E-2, true, false, null], "b": {"c": "x\\"y\\u00e9\\ud83d\\ude00"}}',
    "[]",
    "{}",
    ' [ { } , [ ] , "" ] ',
    '"\\/\\b\\f\\n\\r\\t"',
    "[-0, 0.0, 1E+2]",
    '{"lone": "\\ud800x"}',
]
JSON_BAD = [
    "[01]",
    "[1.]",
    "[.5]",
    "[-]",
    "[1e]",
    "[NaN]",
    "[Infinity]",
    "[tru]x",
    "[1,]",
    '{"a" 1}',
    '{"a": 1,}',
    "{,}",
    "{1: 2}",
    '["\\x"]',
    '["\\u12g4"]',
    '["a\nb"]',
    "[1]]",
    "[}",
    '{"a": ]',
]


def scan(text: str) -> bool:
    """Whether JsonScanner takes all of `text` (spaces around it aside) as one value."""
    j = JsonScanner()
    body = text.strip()
    return all(j.feed(c) for c in body) and j.done


@pytest.mark.parametrize("text", JSON_GOOD + JSON_BAD)
def test_json_scanner_agrees_with_json_loads(text):
    assert scan(text) == (text in JSON_GOOD)
    if text in JSON_GOOD:
        # Strings are decoded as json.loads decodes them.
        expected = json.loads(text)
        if isinstance(expected, str):
            j = JsonScanner()
            for c in text.strip():
                j.feed(c)
            assert j.string == expected


def test_json_scanner_on_random_documents():
    rng = random.Random(11)

    def value(depth: int):
        kind = rng.choice(["int", "float", "str", "lit", "list", "dict"] if depth < 3 else ["str"])
        if kind == "int":
            return rng.randint(-(10**6), 10**6)
        if kind == "float":
            return rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-30, 30)
        if kind == "str":
            return "".join(rng.choice('ab"\\\n\u00e9\U0001f600 ') for _ in range(rng.randint(0, 6)))
        if kind == "lit":
            return rng.choice([True, False, None])
        if kind == "list":
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {f"k{i}": value(depth + 1) for i in range(rng.randint(0, 3))}

    for _ in range(200):
        doc = {"v": value(0)}
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        assert scan(text), text
        cut = rng.randrange(1, len(text))
        assert not scan(text[:cut])  # a proper prefix is never a whole object
