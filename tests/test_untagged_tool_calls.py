"""Hermes calls whose `<tool_call>` tag the model left out (issue 33, item 9): the parser's
rule, fed whole, in every split and cut anywhere. Qwen2.5-0.5B-Instruct answers "What is the
weather in Paris? Use the tool." with the bare object `UNTAGGED` below (transformers' greedy
output on its GGUF is the same). With the request's tool names the parser reads such an object
at the start of the reply as a call; anything else is content exactly as written. The server
side (openai client, both APIs) is in `test_untagged_tool_calls_server.py`.
"""

from __future__ import annotations

import json

import pytest
from tool_call_outputs import TIME, WEATHER, splits, streamed

from tallow.server.chat_output import ChatOutputOptions, parse_choice
from tallow.server.tool_calls import HermesParser, parser_for_template

NAMES = ("get_weather", "get_time")
UNTAGGED = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARIS = '{"city": "Paris"}'

# (text, expected content, expected [(name, arguments)]) with NAMES offered.
CALLS = [
    (UNTAGGED, None, [("get_weather", PARIS)]),
    ("\n  " + UNTAGGED + "\n", None, [("get_weather", PARIS)]),
    (  # parallel calls, one per line
        f'{{"name": "get_weather", "arguments": {WEATHER}}}\n'
        f'{{"name": "get_time", "arguments": {TIME}}}',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (  # Llama's key, the model's own spacing, an escaped name
        '{ "name" : "get\\u005ftime","parameters":{} }',
        None,
        [("get_time", "{}")],
    ),
    (UNTAGGED + "\n</tool_call>", None, [("get_weather", PARIS)]),  # only `<tool_call>` left out
    (  # only the opening tag left out; then a tagged call
        f"{UNTAGGED}\n</tool_call>\n<tool_call>\n"
        f'{{"name": "get_time", "arguments": {TIME}}}\n</tool_call>',
        None,
        [("get_weather", PARIS), ("get_time", TIME)],
    ),
    # Text after the calls is content (a call is sent once its object is complete).
    (
        UNTAGGED + "\nI will check the weather.",
        "I will check the weather.",
        [("get_weather", PARIS)],
    ),
    (UNTAGGED + "}", "}", [("get_weather", PARIS)]),
    (UNTAGGED + "\n<b>Paris</b>", "\n<b>Paris</b>", [("get_weather", PARIS)]),
    (UNTAGGED + "</tool_call></tool_call>", "</tool_call>", [("get_weather", PARIS)]),
    (UNTAGGED + "</tool_call>\n<b>Paris</b>", "<b>Paris</b>", [("get_weather", PARIS)]),
    (  # each call's opening tag left out
        f'{UNTAGGED}\n</tool_call>\n{{"name": "get_time", "arguments": {{}}}}</tool_call>',
        None,
        [("get_weather", PARIS), ("get_time", "{}")],
    ),
    (  # a second object that is no call is content, as written
        UNTAGGED + '\n{"name": "nope", "arguments": {}}',
        '\n{"name": "nope", "arguments": {}}',
        [("get_weather", PARIS)],
    ),
]

# Never a call: the reply is content, byte for byte.
TEXTS = [
    '{"name": "get_wind", "arguments": {"city": "Paris"}}',  # not an offered tool
    '{"name": "get", "arguments": {}}',  # ... only the start of one
    '{"name": "get_weather", "arguments": {"city": Paris}}',  # invalid JSON
    '{"name": "get_weather", "arguments": {"city": "Paris"}',  # not closed
    "Sure: " + UNTAGGED,  # not at the start
    "\n\nSure.\n" + UNTAGGED + "\n",
    '{"name": "get_weather"}',  # no arguments
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',  # arguments a string
    '{"name": "get_weather", "arguments": [1]}',
    '{"arguments": {"city": "Paris"}, "name": "get_weather"}',  # not the format's order
    '{"name": "get_weather", "arguments": {}, "id": 1}',  # another member
    '{"name": "get_weather", "arguments": {}, "arguments": {}}',
    '{"answer": 42}\n',
    '  {"city": "Paris", "temp": 18}  ',
    "{}",
    "{",
    "Just text, no calls.  ",
]


def offered() -> HermesParser:
    return HermesParser(NAMES)


@pytest.mark.parametrize(("text", "content", "calls"), CALLS)
def test_untagged_calls_every_split(text, content, calls):
    got_content, got = offered().parse(text)
    assert (got_content, [(c.name, c.arguments) for c in got]) == (content, calls)
    assert all(json.loads(c.arguments) is not None for c in got)
    for pieces in splits(text, 11):
        s_content, s_calls = streamed(offered(), pieces)
        assert (s_content, [(c.name, c.arguments) for c in s_calls]) == (content, calls), pieces


@pytest.mark.parametrize("text", TEXTS)
def test_anything_else_is_the_text_as_written(text):
    assert offered().parse(text) == (text, [])
    for pieces in splits(text, 5) if len(text) > 1 else [[text]]:
        assert streamed(offered(), pieces) == (text, []), pieces


def test_without_the_requests_tools_an_untagged_object_is_text():
    assert HermesParser().parse(UNTAGGED) == (UNTAGGED, [])
    assert parser_for_template("<tool_call></tool_call>", ["f"]).tool_names == {"f"}
    assert parser_for_template("<tool_call></tool_call>").tool_names == frozenset()


def test_cut_anywhere_is_text_until_the_object_is_complete():
    """max_tokens may cut the reply anywhere: before the object's last `}` it is content as
    written, from there on the call; the stream agrees with the parse."""
    text = UNTAGGED + "\n" + UNTAGGED.replace("Paris", "Oslo")
    first = len(UNTAGGED)
    for n in range(len(text) + 1):
        cut = text[:n]
        content, calls = offered().parse(cut)
        if n < first:
            assert (content, calls) == (cut, [])
        else:
            assert calls[0].arguments == PARIS
            assert len(calls) == 1 + (n == len(text))
            # The second object, while incomplete, is content as written (spaces at the
            # edges of content are dropped when the reply made calls).
            rest = cut[first:] if n < len(text) else ""
            assert content == (rest.rstrip() if rest.strip() else None)
        half = [cut[: n // 2], cut[n // 2 :]]
        s_content, s_calls = streamed(offered(), half)
        assert s_content == content
        assert [(c.name, c.arguments) for c in s_calls] == [(c.name, c.arguments) for c in calls]


def feed_chars(text: str) -> list[tuple[str, list]]:
    """What each character's feed releases: (content, [(name, arguments)])."""
    stream = offered().stream()
    out = []
    for ch in text:
        d = stream.feed(ch)
        out.append((d.content, [(x.name, x.arguments) for x in d.tool_calls]))
    return out


def test_a_call_is_sent_whole_when_its_object_ends_and_never_as_content():
    released = feed_chars(UNTAGGED)
    assert all(r == ("", []) for r in released[:-1])
    assert released[-1] == ("", [("get_weather", ""), (None, PARIS)])


@pytest.mark.parametrize(
    ("text", "decided_at"),
    [
        ('{"answer": 42}', '{"a'),
        ('{"name": "set_alarm", "arguments": {}}', '{"name": "s'),
        ('{"name": "get_weather_now", "arguments": {}}', '{"name": "get_weather_'),
        ('{"name": "get_weather", "id": 3}', '{"name": "get_weather", "i'),
        ('{"name": "get_weather", "arguments": 3}', '{"name": "get_weather", "arguments": 3'),
        ("Hello.", "H"),
        ("  [1, 2]", "  ["),
    ],
)
def test_text_is_released_as_soon_as_it_cannot_be_a_call(text, decided_at):
    """Ordinary text is not held back: at the first character that rules out an offered call
    object, everything read so far is sent as content."""
    released = feed_chars(text)
    n = len(decided_at)
    assert all(r == ("", []) for r in released[: n - 1]), released
    assert "".join(c for c, _ in released[:n]) == decided_at.rstrip()
    assert "".join(c for c, _ in released) + offered().stream().finish().content == text.rstrip()


def test_parallel_off_keeps_the_first_untagged_call():
    text = CALLS[2][0]
    content, calls = offered().parse(text, max_calls=1)
    assert content is None and [c.name for c in calls] == ["get_weather"]


def test_after_reasoning():
    options = ChatOutputOptions(tool_parser=offered(), reasoning=True)
    parsed = parse_choice(options, "<think>\nThe tool knows.\n</think>\n\n" + UNTAGGED)
    assert parsed.reasoning == "The tool knows." and parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", PARIS)]
