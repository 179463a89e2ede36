"""Tool-call parsers and the reasoning splitter on recorded model outputs (written for these
tests in each family's format): whole-text parses, and the streaming parsers fed every split
of the text reassemble to exactly the whole-text parse; a call's name comes before its
arguments end, and its arguments in pieces. Malformed and cut-off calls follow the rule in
`tallow.server.tool_calls.base`. The incremental JSON checker agrees with `json.loads`.
Forced-call grammars compile in llguidance and accept the calls they are meant to force."""

from __future__ import annotations

import json
import random

import pytest

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
from tallow.server.tool_calls.base import StreamDelta, collect
from tallow.server.tool_calls.json_stream import JsonScanner

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


# -- forced-call grammars ----------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def ll_tokenizer(tmp_path_factory):
    llguidance = pytest.importorskip("llguidance")
    from tokenizers import Tokenizer

    from tiny_models import make_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder, 320)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return llguidance.LLTokenizer(tok.to_str(), eos_token=tok.token_to_id("</s>"))


def accepts(ll_tokenizer, lark: str, text: str) -> bool:
    from llguidance import LLMatcher

    matcher = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(ll_tokenizer.tokenize_str(text))
    return ok and matcher.is_accepting()


GRAMMAR_CASES = [
    (
        HermesParser,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>',
    ),
    (
        Llama3JsonParser,
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        '{"name": "get_weather", "parameters": {"city": 3}}',
    ),
    (
        MistralParser,
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[{"name": "get_time", "arguments": {}}]',
    ),
    (
        JsonListParser,
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
        '[{"name": "get_weather", "parameters": {"unit": "kelvin"}}]',
    ),
]


@pytest.mark.parametrize(("parser_cls", "good", "bad"), GRAMMAR_CASES)
def test_forced_call_grammars(ll_tokenizer, parser_cls, good, bad):
    from llguidance import LLMatcher

    parser = parser_cls()
    named = parser.forced_call_grammar(TOOLS, NAMED, parallel=False)
    anyof = parser.forced_call_grammar(TOOLS, "required", parallel=True)
    for lark in (named, anyof):
        failed, messages = LLMatcher.validate_grammar_with_warnings(
            LLMatcher.grammar_from_lark(lark)
        )
        assert not failed, (lark, messages)
    assert accepts(ll_tokenizer, named, good)
    assert not accepts(ll_tokenizer, named, bad)
    # What the grammar makes the model write is what the parser reads back.
    content, calls = parser.parse(good)
    assert content is None and calls[0].name == "get_weather"


def test_required_grammar_allows_any_tool_and_parallel_calls(ll_tokenizer):
    lark = HermesParser().forced_call_grammar(TOOLS, "required", parallel=True)
    two = (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert accepts(ll_tokenizer, lark, two)
    single = HermesParser().forced_call_grammar(TOOLS, "required", parallel=False)
    assert not accepts(ll_tokenizer, single, two)
    with pytest.raises(ValueError):
        HermesParser().forced_call_grammar(TOOLS, {"function": {"name": "nope"}})


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
