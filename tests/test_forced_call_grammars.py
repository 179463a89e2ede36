"""Forced-call grammars (`tool_choice` required or named) compile in llguidance and accept the
calls they are meant to force, and nothing else.
"""

from __future__ import annotations

import pytest

from tallow.server.tool_calls import (
    HermesParser,
    JsonListParser,
    Llama3JsonParser,
    MistralParser,
)

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
