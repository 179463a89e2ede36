"""Tool-call parsers and the reasoning splitter on recorded model outputs (written for these
tests in each family's format): whole-text parses, and the streaming parsers fed every split
of the text reassemble to exactly the whole-text parse. Forced-call grammars compile in
llguidance and accept the calls they are meant to force."""

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
        HermesParser,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
        [],
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
        Llama3JsonParser,  # cut off mid-call: plain content
        '{"name": "get_weather", "parameters": {',
        '{"name": "get_weather", "parameters": {',
        [],
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
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }]',
        [],
    ),
    (MistralParser, "[1] is a citation.", "[1] is a citation.", []),
    # The generic forced format
    (
        JsonListParser,
        f'[{{"name": "get_weather", "parameters": {WEATHER}}}]',
        None,
        [("get_weather", WEATHER)],
    ),
]


def splits(text: str, seed: int) -> list[list[str]]:
    """The text char by char, and in random chunkings."""
    rng = random.Random(seed)
    out = [list(text)]
    for _ in range(12):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def streamed(parser, pieces: list[str], max_calls=None):
    stream = parser.stream(max_calls)
    total = StreamDelta()
    for piece in pieces:
        d = stream.feed(piece)
        # Each call's first delta carries its id and name, before any arguments.
        seen = {x.index for x in total.tool_calls}
        for x in d.tool_calls:
            if x.index not in seen:
                assert x.id and x.name and not x.arguments
                seen.add(x.index)
        total += d
    total += stream.finish()
    return collect(total)


@pytest.mark.parametrize(("parser_cls", "text", "content", "calls"), CASES)
def test_parse_and_stream_every_split(parser_cls, text, content, calls):
    parser = parser_cls()
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        json.loads(c.arguments)
        assert c.id
    for i, pieces in enumerate(splits(text, hash(text) % 1000)):
        s_content, s_calls = streamed(parser, pieces)
        assert s_content == got_content, (i, pieces)
        assert [(c.name, c.arguments) for c in s_calls] == calls, (i, pieces)


def test_parallel_off_keeps_the_first_call():
    text = CASES[1][1]
    content, calls = HermesParser().parse(text, max_calls=1)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert streamed(HermesParser(), list(text), max_calls=1)[1][0].name == "get_weather"


def test_call_ids():
    _, calls = HermesParser().parse(CASES[1][1])
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in calls)
    assert calls[0].id != calls[1].id
    _, calls = MistralParser().parse(CASES[14][1])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


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
