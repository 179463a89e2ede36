"""Tool-call parsers and the reasoning splitter on recorded model outputs (written for these
tests in each family's format): whole-text parses, and the streaming parsers fed every split
of the text reassemble to exactly the whole-text parse; a call's name comes before its
arguments end, and its arguments in pieces. Malformed and cut-off calls follow the rule in
`tallow.server.tool_calls.stream`. The format is picked from the chat template.
"""

from __future__ import annotations

import pytest
from tool_call_outputs import (
    CASES,
    LONG_ARGS,
    MISTRAL_V11,
    TIME,
    WEATHER,
    is_json,
    splits,
    streamed,
)

from tallow.server.chat_output import ChatOutputOptions, ChoiceStream, parse_choice
from tallow.server.reasoning import (
    ReasoningStream,
    prompt_opens_reasoning,
    split_reasoning,
    template_has_reasoning,
)
from tallow.server.tool_calls import (
    TOOL_PARSERS,
    HermesParser,
    JsonListParser,
    Llama3JsonParser,
    MistralParser,
    parser_for_template,
)
from tallow.server.tool_calls.deltas import StreamDelta


@pytest.mark.parametrize(("parser_cls", "text", "content", "calls"), CASES)
def test_parse_and_stream_every_split(parser_cls, text, content, calls):
    parser = parser_cls()
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(c.id for c in got_calls)
    for i, pieces in enumerate(splits(text, hash(text) % 1000)):
        s_content, s_calls = streamed(parser, pieces)
        assert s_content == got_content, (i, pieces)
        assert [(c.name, c.arguments) for c in s_calls] == calls, (i, pieces)


@pytest.mark.parametrize(("parser_cls", "text", "content", "calls"), CASES)
def test_cut_anywhere(parser_cls, text, content, calls):
    """Output cut at any point (max_tokens) never fails: each call's arguments are a prefix of
    the whole output's, what was sent is the start of well-formed JSON, and the stream agrees
    with the parse."""
    parser = parser_cls()
    full = dict(enumerate(args for _, args in calls))
    for n in range(len(text)):
        cut = text[:n]
        got_content, got_calls = parser.parse(cut)
        for i, c in enumerate(got_calls):
            if is_json(full.get(i, "")):
                assert c.name == calls[i][0] and full[i].startswith(c.arguments), (cut, c)
        s_content, s_calls = streamed(parser, [cut[: n // 2], cut[n // 2 :]])
        assert s_content == got_content
        assert [(c.name, c.arguments) for c in s_calls] == [
            (c.name, c.arguments) for c in got_calls
        ]


@pytest.mark.parametrize(
    ("parser_cls", "text"),
    [
        (
            HermesParser,
            f'<tool_call>\n{{"name": "plan_trip", "arguments": {LONG_ARGS}}}\n</tool_call>',
        ),
        (Llama3JsonParser, f'{{"name": "plan_trip", "parameters": {LONG_ARGS}}}'),
        (MistralParser, f"[TOOL_CALLS]plan_trip[ARGS]{LONG_ARGS}"),
        (MistralParser, f'[{{"name": "plan_trip", "arguments": {LONG_ARGS}}}]'),
        (JsonListParser, f'[{{"name": "plan_trip", "parameters": {LONG_ARGS}}}]'),
    ],
)
def test_name_first_then_arguments_in_pieces(parser_cls, text):
    parser = parser_cls()
    for pieces in (list(text), [text[i : i + 7] for i in range(0, len(text), 7)]):
        log: list[StreamDelta] = []
        content, calls = streamed(parser, pieces, log=log)
        assert content is None and [(c.name, c.arguments) for c in calls] == [
            ("plan_trip", LONG_ARGS)
        ]
        named = next(i for i, d in enumerate(log) if any(x.name for x in d.tool_calls))
        with_args = [i for i, d in enumerate(log) if any(x.arguments for x in d.tool_calls)]
        # The name comes before the arguments end, and they come in many pieces.
        assert named <= with_args[0] and with_args[-1] > named
        assert len(with_args) > 10
        # Every piece sent so far is the start of the final arguments.
        sent = ""
        for d in log:
            sent += "".join(x.arguments for x in d.tool_calls)
            assert LONG_ARGS.startswith(sent)


def test_tag_starts_the_call_at_its_name():
    """After a format's tag the call starts once its name is complete; after bare JSON only
    once the arguments begin."""
    stream = HermesParser().stream()
    d = stream.feed('<tool_call>\n{"name": "get_weather"')
    assert [(x.name, x.arguments) for x in d.tool_calls] == [("get_weather", "")]
    d = stream.feed(', "arguments": {"ci')
    assert [(x.name, x.arguments) for x in d.tool_calls] == [(None, '{"ci')]
    stream = Llama3JsonParser().stream()
    assert not stream.feed('{"name": "get_weather"').tool_calls
    d = stream.feed(', "parameters": {"ci')
    assert [(x.name, x.arguments) for x in d.tool_calls] == [("get_weather", ""), (None, '{"ci')]


def test_content_and_calls_keep_their_order():
    text = f'Before.\n<tool_call>{{"name": "get_time", "arguments": {TIME}}}</tool_call>\nAfter.'
    stream = HermesParser().stream()
    d = stream.feed(text)
    d += stream.finish()
    assert [p if isinstance(p, str) else p.arguments for p in d.parts] == [
        "Before.",
        "",
        TIME,
        "\n\nAfter.",  # the whitespace before the call is held until content follows
    ]


def test_parallel_off_keeps_the_first_call():
    text = CASES[1][1]
    content, calls = HermesParser().parse(text, max_calls=1)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", WEATHER)]
    for pieces in splits(text, 5):
        assert [c.name for c in streamed(HermesParser(), pieces, max_calls=1)[1]] == ["get_weather"]
    stream = HermesParser().stream(max_calls=1)
    stream.feed(text)
    assert stream.num_calls == 1


def test_call_ids():
    _, calls = HermesParser().parse(CASES[1][1])
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in calls)
    assert calls[0].id != calls[1].id
    _, calls = MistralParser().parse(MISTRAL_V11)
    assert len(calls) == 2 and all(len(c.id) == 9 and c.id.isalnum() for c in calls)


# -- picking a parser from the chat template -------------------------------------------------

QWEN_SNIPPET = "{{- '<tool_call>\\n' }}{{ tool_call.arguments | tojson }}{{- '\\n</tool_call>' }}"
LLAMA_SNIPPET = (
    "<|start_header_id|>user<|end_header_id|>{{- '\"parameters\": dictionary of argument name' }}"
)
MISTRAL_SNIPPET = "{{- '[TOOL_CALLS]' }}{{ message.tool_calls | tojson }}"


def test_parser_for_template():
    assert isinstance(parser_for_template(QWEN_SNIPPET), HermesParser)
    assert isinstance(parser_for_template(LLAMA_SNIPPET), Llama3JsonParser)
    assert isinstance(parser_for_template(MISTRAL_SNIPPET), MistralParser)
    assert parser_for_template("{{ messages }}") is None
    assert parser_for_template(None) is None
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}


# -- reasoning ---------------------------------------------------------------------------------

REASONING_CASES = [
    # (text, starts_inside, reasoning, content)
    ("<think>\nThe user wants X.\n</think>\n\nX it is.", False, "The user wants X.", "X it is."),
    ("The user wants X.\n</think>\n\nX it is.", True, "The user wants X.", "X it is."),
    (
        "No thinking here. <think>not reasoning</think>",
        False,
        None,
        "No thinking here. <think>not reasoning</think>",
    ),
    ("<think>\nstill thinking when cut off", False, "still thinking when cut off", ""),
    ("<think>\n\n</think>\n\nDirect answer.", False, "", "Direct answer."),
    ("<thin", False, None, "<thin"),
    ("  <think>a < b </thin </think>ok", False, "a < b </thin", "ok"),
]


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split_every_split(text, inside, reasoning, content):
    assert split_reasoning(text, inside) == (reasoning, content)
    for pieces in splits(text, 7) if len(text) > 1 else [[text]]:
        stream = ReasoningStream(inside)
        r, c = "", ""
        for piece in [*pieces, None]:
            d = stream.finish() if piece is None else stream.feed(piece)
            r, c = r + d.reasoning, c + d.content
        assert (r if stream.saw_reasoning else None, c) == (reasoning, content), pieces


def test_reasoning_detection():
    qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>"
    assert template_has_reasoning(qwen3) and not template_has_reasoning("{{ messages }}")
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<think>old</think> user: hi")


def test_reasoning_then_tool_calls_every_split():
    options = ChatOutputOptions(tool_parser=HermesParser(), reasoning=True)
    text = (
        "<think>\nI should call the tool.\n</think>\n\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>'
    )
    parsed = parse_choice(options, text)
    assert parsed.reasoning == "I should call the tool." and parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", WEATHER)]
    for pieces in splits(text, 3):
        stream = ChoiceStream(options)
        r, c, args = "", "", ""
        for piece in [*pieces, None]:
            d = stream.finish() if piece is None else stream.feed(piece)
            r, c = r + d.reasoning, c + d.content
            args += "".join(x.arguments for x in d.tool_calls)
        assert (r, c, args) == (parsed.reasoning, "", WEATHER)
        assert stream.made_tool_calls
