"""Recorded model outputs in each tool-call format (written for the tests), with the content
and calls each must parse to, and the helpers that feed them to a parser whole, in every
split, or cut off anywhere.
"""

from __future__ import annotations

import json
import random

from tallow.server.tool_calls import (
    HermesParser,
    JsonListParser,
    Llama3JsonParser,
    MistralParser,
)
from tallow.server.tool_calls.deltas import StreamDelta, collect

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"tz": "Europe/Paris"}'

# (parser, text, expected content, expected [(name, arguments)])
CASES = [
    # Hermes / Qwen
    (
        HermesParser,
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        HermesParser,
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "get_time", "arguments": {TIME}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        HermesParser,
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
        "</tool_call>\nOne moment.",
        "Let me check.\n\nOne moment.",
        [("get_weather", WEATHER)],
    ),
    (
        HermesParser,  # malformed once the call started: it ends there, the rest is content
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
        "\n</tool_call>",
        [("get_weather", '{"city": "Par')],
    ),
    (
        HermesParser,  # malformed before the name is known: all content, as written
        '<tool_call>\n{"arguments": {"city": }}\n</tool_call> ok',
        '<tool_call>\n{"arguments": {"city": }}\n</tool_call> ok',
        [],
    ),
    (
        HermesParser,  # arguments that are not an object
        '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
        "[1]}</tool_call>",
        [("get_weather", "")],
    ),
    (
        HermesParser,  # keys in any order, other keys ignored, the model's own JSON text
        '<tool_call>{"arguments": {"a":[1,2.5e3,true,null],"b":"\\u00fc"}, "x": -0.5, '
        '"name": "f"}</tool_call>',
        None,
        [("f", '{"a":[1,2.5e3,true,null],"b":"\\u00fc"}')],
    ),
    (HermesParser, '<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", "{}")]),
    (
        HermesParser,  # a tag inside a failed region starts a new one
        '<tool_call><tool_call>{"name": "get_time"}</tool_call>',
        "<tool_call>",
        [("get_time", "{}")],
    ),
    (
        HermesParser,
        "<tool_call>\nnot json\n</tool_call>",
        "<tool_call>\nnot json\n</tool_call>",
        [],
    ),
    (HermesParser, 'a < b and <tool_call{"x"', 'a < b and <tool_call{"x"', []),
    (
        HermesParser,  # stopped right after the JSON, no closing tag
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        HermesParser,  # arguments sent as a JSON string, and non-ASCII text
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Zürich\\"}"}</tool_call>',
        None,
        [("get_weather", '{"city": "Zürich"}')],
    ),
    (HermesParser, "Just text, no calls.  ", "Just text, no calls.  ", []),
    # Llama 3.x JSON
    (
        Llama3JsonParser,
        f'{{"name": "get_weather", "parameters": {WEATHER}}}',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        Llama3JsonParser,
        f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
        f'{{"name": "get_time", "parameters": {TIME}}}',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        Llama3JsonParser,  # text first: Llama answers either with calls or with text
        'The weather tool wants {"city": "Paris"}.',
        'The weather tool wants {"city": "Paris"}.',
        [],
    ),
    (
        Llama3JsonParser,  # cut off once the arguments began: the call ends there
        '{"name": "get_weather", "parameters": {"ci',
        None,
        [("get_weather", '{"ci')],
    ),
    (
        Llama3JsonParser,  # bare JSON: the name alone does not start a call
        '{"name": "get_weather", "para',
        '{"name": "get_weather", "para',
        [],
    ),
    (
        Llama3JsonParser,  # after a complete call, text that is no call is content
        '{"name": "get_time", "parameters": {}}; and then',
        "and then",
        [("get_time", "{}")],
    ),
    (Llama3JsonParser, '{"answer": 42}', '{"answer": 42}', []),
    # Mistral
    (
        MistralParser,
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
        f'{{"name": "get_time", "arguments": {TIME}}}]',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        MistralParser,
        f"Sure. [TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{TIME}",
        "Sure.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        MistralParser,  # the special token dropped by the detokenizer
        f' [{{"name": "get_weather", "arguments": {WEATHER}}}]',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        MistralParser,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }]',
        "}]",
        [("get_weather", '{"city": ')],
    ),
    (
        MistralParser,  # the list's end closes the region; what follows is content
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}] Done.',
        "Done.",
        [("get_weather", WEATHER)],
    ),
    (MistralParser, "[TOOL_CALLS][] no calls", "[TOOL_CALLS][] no calls", []),
    (MistralParser, "[1] is a citation.", "[1] is a citation.", []),
    # The generic forced format
    (
        JsonListParser,
        f'[{{"name": "get_weather", "parameters": {WEATHER}}}]',
        None,
        [("get_weather", WEATHER)],
    ),
]


MISTRAL_V11 = f"Sure. [TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{TIME}"
LONG_ARGS = json.dumps({"city": "Paris", "notes": "a long note " * 20, "days": list(range(30))})


def splits(text: str, seed: int) -> list[list[str]]:
    """The text char by char, and in random chunkings."""
    rng = random.Random(seed)
    out = [list(text)]
    for _ in range(12):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def streamed(parser, pieces: list[str], max_calls=None, log: list | None = None):
    """The stream's deltas added up and collected; `log` gets each feed's delta."""
    stream = parser.stream(max_calls)
    total = StreamDelta()
    for piece in [*pieces, None]:
        d = stream.finish() if piece is None else stream.feed(piece)
        # Each call's first delta carries its id and name, and no arguments; later ones only
        # arguments.
        seen = {x.index for x in total.tool_calls}
        for x in d.tool_calls:
            if x.index not in seen:
                assert x.id and x.name and not x.arguments
                seen.add(x.index)
            else:
                assert x.id is None and x.name is None and x.arguments
        if log is not None:
            log.append(d)
        total += d
    return collect(total)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
