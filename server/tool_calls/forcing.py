"""Forcing tool calls (`tool_choice: "required"` or a named function) with a grammar.

The grammar is built by the model's tool-call format (`ToolCallParser.forced_call_grammar`)
and put on the request's `SamplingParams.grammar`; the engine masks the logits of rows that
carry one (`tallow.runtime.constraint`), so even a weak model writes a call whose arguments
follow the tool's JSON schema.
"""

from __future__ import annotations

from typing import Any

from tallow.runtime.constraint import GrammarError, lark_grammar
from tallow.runtime.served_model import ServedModel

from .base import ToolCallParser


def forced_tool_grammar(
    parser: ToolCallParser,
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any],
    parallel: bool,
    model: ServedModel,
) -> str:
    """The llguidance grammar forcing calls in `parser`'s format for `model`'s tokenizer;
    raises `GrammarError` when llguidance cannot enforce it (e.g. a tool schema it refuses)."""
    added = {t.content for t in model.tokenizer.get_added_tokens_decoder().values()}
    lark = parser.forced_call_grammar(tools, tool_choice, parallel, added_tokens=added)
    grammar = lark_grammar(lark)
    model.check_grammar(grammar)  # compiled now (off the event loop), cached for the engine
    return grammar


__all__ = ["GrammarError", "forced_tool_grammar"]
