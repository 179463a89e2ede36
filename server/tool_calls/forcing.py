"""Forcing tool calls (`tool_choice: "required"` or a named function) with a grammar.

The grammar is built by the model's tool-call format (`ToolCallParser.forced_call_grammar`)
and put on the request's `SamplingParams`, where the engine masks the logits of rows that
carry one. That engine half lives in the constrained-decoding work (`SamplingParams.grammar`,
`tallow.runtime.constraint`): `attach_tool_grammar` is the single point that connects to it.
Until `SamplingParams` has a `grammar` field, nothing is attached and the model answers
unconstrained (its output is still parsed for calls).
"""

from __future__ import annotations

from typing import Any

from tallow.runtime.sampling_params import SamplingParams

from .base import ToolCallParser


def forced_tool_grammar(
    parser: ToolCallParser,
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any],
    parallel: bool,
) -> str:
    """The Lark grammar forcing calls in `parser`'s format."""
    return parser.forced_call_grammar(tools, tool_choice, parallel)


def grammar_problem(lark: str) -> str | None:
    """Why llguidance would refuse this Lark grammar (e.g. a tool schema it cannot enforce),
    or None if it compiles (or llguidance is not installed to ask)."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        return None
    failed, messages = LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_lark(lark))
    if not failed:
        return None
    return "; ".join(m.strip() for m in messages) or "invalid grammar"


def engine_supports_grammars() -> bool:
    return hasattr(SamplingParams(), "grammar")


def attach_tool_grammar(params: SamplingParams, lark: str) -> bool:
    """Put the forced-call grammar on `params`; False if the engine cannot take grammars yet.

    MERGE POINT: with the constrained-decoding branch in, `SamplingParams.grammar` exists and
    this sets it, converted by `tallow.runtime.constraint.lark_grammar` when that module is
    there (the engine's own check, `check_grammar`, then runs where the engine runs it).
    """
    if not hasattr(params, "grammar"):
        return False
    try:
        from tallow.runtime.constraint import lark_grammar  # type: ignore[import-not-found]
    except ImportError:
        params.grammar = lark  # type: ignore[attr-defined]
    else:
        params.grammar = lark_grammar(lark)  # type: ignore[attr-defined]
    return True
