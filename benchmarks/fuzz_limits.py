"""tallow's fuzz cases near and past the limits (a mixin of `fuzz_cases.TallowCases`): JSON
nested hundreds deep, grammars and schemas of thousands of rules, thousands of choices,
prompts around the context window and bodies around the body limit, and malformed bodies.
Several are what once crashed or stalled the server (issue 33; their `item`); their statuses
are now exact: under a limit 200, past it 400 (`tallow.runtime.grammar_limits`,
`server.context.MAX_JSON_DEPTH`)."""

from __future__ import annotations

import json
from typing import Any

from fuzz_case import BAD, CHAT, COMPLETIONS, DETOKENIZE, EMBEDDINGS, OK, RESPONSES, TOKENIZE, Case

from tallow.runtime.grammar_limits import MAX_GRAMMAR_RULES, MAX_SCHEMA_REFS
from tallow.server.context import MAX_JSON_DEPTH


def _chain_lark(n: int) -> str:
    """A Lark grammar of `n` chained rules (r0: "a" r1, ...): llguidance recurses per rule."""
    rules = [f'r{i}: "a" r{i + 1}' for i in range(n)] + [f'r{n}: "b"']
    return "start: r0\n" + "\n".join(rules)


def _chain_refs(n: int) -> dict[str, Any]:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


DEEP = "__deep__"


def _with_deep(body: dict[str, Any], depth: int) -> bytes:
    """`body` as JSON text with `DEEP` replaced by objects nested `depth` deep (as text:
    Python's own json module cannot write what is deeper than its recursion limit)."""
    deep = '{"a": ' * depth + "1" + "}" * depth
    return json.dumps(body).replace(json.dumps(DEEP), deep).encode()


class LimitCases:
    """Generators (`gen_*`) using `TallowCases`' helpers (`_gen`, `_case`, `_pick`, ...)."""

    def gen_deep_tool_parameters(self) -> Case:
        """JSON nested far past the body limit in a tool's parameters (500 deep once met
        Python's recursion limit: a 500, item 3), or just within it."""
        params = {"type": "object", "properties": {"x": DEEP}}
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        depth = self._pick(100, 500, 2000)  # the body's own 6 levels hold it
        raw = _with_deep(self._gen(CHAT, tools=tools), depth)
        expect = OK | BAD if depth + 6 <= MAX_JSON_DEPTH else BAD  # within: the tool's own 400s
        return self._case("deep:tool_parameters", CHAT, None, raw=raw, expect=expect, item=3)

    def gen_deep_template_kwargs(self) -> Case:
        body = self._gen(CHAT, chat_template_kwargs={"x": DEEP})
        depth = self._pick(100, MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH - 1, 475, 2000)
        raw = _with_deep(body, depth)  # the body's own 2 levels hold it
        expect = OK if depth + 2 <= MAX_JSON_DEPTH else BAD
        return self._case("deep:chat_template_kwargs", CHAT, None, raw=raw, expect=expect, item=3)

    def gen_big_grammar(self) -> Case:
        """Grammars and schemas at and past the limits (3,000 chained rules or `$ref`s once
        crashed the server, item 1)."""
        n = self._pick(50, 500, MAX_GRAMMAR_RULES - 2, MAX_GRAMMAR_RULES - 1, 3000)
        if self.rng.random() < 0.5:
            body = self._gen(COMPLETIONS, guided_grammar=_chain_lark(n))
            expect = OK if n + 2 <= MAX_GRAMMAR_RULES else BAD  # n + 2 definitions
            return self._case("big:lark_rules", COMPLETIONS, body, expect=expect, item=1)
        body = self._gen(COMPLETIONS, guided_json=_chain_refs(n))
        expect = OK if n + 1 <= MAX_SCHEMA_REFS else BAD  # n + 1 `$ref`s
        return self._case("big:schema_refs", COMPLETIONS, body, expect=expect, item=1)

    def gen_many_choices(self) -> Case:
        """Thousands of options (past 2,000 they once ended in "grammar_error", item 6)."""
        n = self._pick(500, 2000, 5000, 60_000)
        body = self._gen(COMPLETIONS, guided_choice=[f"option {i}" for i in range(n)])
        return self._case("big:guided_choice", COMPLETIONS, body, expect=OK, item=6)

    def gen_long_prompt(self) -> Case:
        """Prompts around the context window (in tokens) and the body limit (in bytes)."""
        r = self.rng
        if r.random() < 0.8:
            ids = [
                r.randrange(self.vocab) for _ in range(self.window + self._pick(-8, -1, 0, 1, 100))
            ]
            body = self._gen(COMPLETIONS, prompt=ids, max_tokens=1)
            kind = "size:window_tokens"
            return self._case(
                kind, COMPLETIONS, body, expect=OK | BAD, costly=len(ids) <= self.window
            )
        size = self.max_body + self._pick(-4096, -200, 1, 1000)
        base = {"model": self.model, "prompt": "", "max_tokens": 1}
        filler = size - len(json.dumps(base).encode())
        body = base | {"prompt": ("word " * (filler // 5 + 1))[:filler]}
        over = size > self.max_body
        expect = frozenset({413}) if over else OK | BAD
        # Tokenizing megabytes once stalled the event loop and /health (item 2).
        kind = "size:body_limit"
        return self._case(
            kind, COMPLETIONS, body, expect=expect, may_reset=over, item=None if over else 2
        )

    def gen_raw_bodies(self) -> Case:
        path = self._pick(CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS, TOKENIZE, DETOKENIZE)
        raw, headers, expect = self._pick(
            (b"{", None, BAD),
            (b'{"model": NaN}', None, BAD),
            (b'{"prompt": 1e999}', None, BAD),
            (b"[1, 2]", None, BAD),
            (b"\xff\xfe{}", None, BAD),
            (b"", None, BAD),
            (b'{"model": "x"}', {"Content-Type": "text/plain"}, frozenset({415})),
            (b'{"model": "x"}', {}, frozenset({415})),
            (
                json.dumps(
                    {
                        "model": "not-this-model",
                        "prompt": "a",
                        "messages": [],
                        "input": "a",
                        "tokens": [1],
                    }
                ).encode(),
                None,
                frozenset({404, 400}),
            ),
            (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, None, BAD),
        )
        headers = {"Content-Type": "application/json"} if headers is None else headers
        return Case("raw_body", "POST", path, raw=raw, headers=headers, expect=expect)
