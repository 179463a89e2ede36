"""How large a grammar tallow hands to llguidance: the limits, checked before it compiles.

llguidance compiles a grammar recursively along chains of rule references, so a long enough
chain overflows the compiling thread's stack, and in native code that is a segfault of the
whole server (issue 33). Measured with `benchmarks/grammar_limits.py` (SmolLM2's tokenizer,
each size in a fresh process; AMD EPYC Zen 3, 2026-12-04):

| shape | survives on an 8 MiB stack | on the 256 MiB compile threads (`deep_stack.py`) |
|---|---|---|
| chained Lark rules (`r0: "a" r1` ...) | 2,560 (2,688 crash) | 86,016 (90,112 crash) |
| chained JSON-schema `$ref`s | 2,432 (2,496 crash) | 131,072 tried, no crash |
| nested parentheses in a rule; nested regex groups | 131,072 tried, no crash | same |
| objects nested in a schema | 480 (Python's own recursion limit first) | same |
| `guided_choice` options (one terminal) | 131,072 tried | same |

Only chains recurse: nesting inside one rule or one regex does not. The limits below keep a
grammar 2.4x or more under the 8 MiB crash, so it is 80x or more under the stack it really
compiles on. Compile time also grows with size: 16,000 alternatives of a Lark rule (255 KiB)
take 1.2 s, 90,000 over 30 s; hence the text limit. A request body's nesting is capped before
any of this (`server.context.MAX_JSON_DEPTH`, 128 levels).

`check_*` raise `GrammarLimitError` (a `GrammarError`, so front ends answer 400) naming the
limit and what the grammar has.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "MAX_CHOICES",
    "MAX_GRAMMAR_CHARS",
    "MAX_GRAMMAR_RULES",
    "MAX_SCHEMA_REFS",
    "GrammarLimitError",
    "check_choices",
    "check_lark",
    "check_regex",
    "check_schema",
]

MAX_GRAMMAR_RULES = 1000  # rule and terminal definitions in a Lark grammar
MAX_SCHEMA_REFS = 1000  # `$ref`s in a JSON schema (a Lark grammar's `%json` schemas too)
MAX_GRAMMAR_CHARS = 128 * 1024  # a Lark grammar or a regex, in characters
MAX_CHOICES = 100_000  # `guided_choice` options (100,000 short ones compile in about 2 s)


class GrammarLimitError(ValueError):
    """A grammar past one of tallow's limits; the message names the limit."""


# A definition starts a line: `name:`, `?name:`, `!name:`, `NAME.2:` (rules and terminals).
_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?[0-9]+)?[ \t]*:", re.M)
_REF_KEY = re.compile(r'"\$ref"\s*:')


def check_lark(text: str) -> None:
    _check_chars(text, "grammar")
    rules = len(_DEFINITION.findall(text))
    if rules > MAX_GRAMMAR_RULES:
        raise GrammarLimitError(
            f"the grammar defines {rules} rules and terminals; the limit is {MAX_GRAMMAR_RULES}"
        )
    refs = len(_REF_KEY.findall(text))
    if refs > MAX_SCHEMA_REFS:
        raise GrammarLimitError(
            f"the grammar's JSON schemas hold {refs} $refs; the limit is {MAX_SCHEMA_REFS}"
        )


def check_regex(pattern: str) -> None:
    _check_chars(pattern, "regex")


def check_choices(choices: list[str]) -> None:
    if len(choices) > MAX_CHOICES:
        raise GrammarLimitError(f"{len(choices)} choices; the limit is {MAX_CHOICES}")


def check_schema(schema: Any) -> None:
    """Count `$ref`s, without recursion (the body's nesting is capped, a schema built in
    Python need not be)."""
    refs, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            refs += "$ref" in node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    if refs > MAX_SCHEMA_REFS:
        raise GrammarLimitError(f"the schema holds {refs} $refs; the limit is {MAX_SCHEMA_REFS}")


def _check_chars(text: str, what: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarLimitError(
            f"the {what} has {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}"
        )
