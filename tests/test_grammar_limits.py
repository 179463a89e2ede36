"""Grammars that crashed the server (issue 33): llguidance overflows the stack of the thread that
compiles a long enough chain of rules, a segfault of the whole process. Grammars now compile on
deep-stack threads (`runtime/deep_stack.py`) and past tallow's limits they are refused with a
400 naming the limit (`runtime/grammar_limits.py`); the streams in flight live on.

The crash tests run the server (or the compile) in a child process: on a build without the
fixes it dies, and the test sees a dead process instead of losing its own worker.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from server_helpers import MODEL, start_process  # noqa: I001

from tallow.runtime import grammar_limits
from tallow.runtime.constraint import (
    GrammarError,
    choice_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from tallow.runtime.grammar_limits import MAX_GRAMMAR_RULES, MAX_SCHEMA_REFS

HERE = Path(__file__).parent
CHAT = [{"role": "user", "content": "Spell it."}]


def chained_rules(n: int) -> str:
    """`start: r0`, `r0: "a" r1`, ... `rn: "b"`: n + 2 definitions, a chain n deep."""
    return "\n".join(["start: r0", *(f'r{i}: "a" r{i + 1}' for i in range(n)), f'r{n}: "b"'])


def chained_refs(n: int) -> dict:
    """A schema whose n + 1 `$ref`s chain n + 1 deep."""
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 3}
    return {"$ref": "#/$defs/d0", "$defs": defs}


# -- the limits, without a server ------------------------------------------------------------


def test_rule_count_counts_definitions_not_alternatives():
    at_limit = chained_rules(MAX_GRAMMAR_RULES - 2)  # n + 2 definitions
    lark_grammar(at_limit)
    with pytest.raises(GrammarError, match=f"defines {MAX_GRAMMAR_RULES + 1} rules"):
        lark_grammar(chained_rules(MAX_GRAMMAR_RULES - 1))
    # Alternatives on continuation lines, terminals and priorities: one definition each.
    text = 'start: a\n    | b\n?a.2: "x" | B\nb: "y"\nB: /[0-9]+/\n'
    assert len(grammar_limits._DEFINITION.findall(text)) == 4


def test_refs_are_counted_in_schemas_and_in_a_grammars_json():
    json_schema_grammar(chained_refs(MAX_SCHEMA_REFS - 1))
    with pytest.raises(GrammarError, match=f"{MAX_SCHEMA_REFS + 1} \\$refs"):
        json_schema_grammar(chained_refs(MAX_SCHEMA_REFS))
    embedded = "start: %json " + json.dumps(chained_refs(MAX_SCHEMA_REFS))
    with pytest.raises(GrammarError, match="\\$refs; the limit"):
        lark_grammar(embedded)


def test_text_and_choice_limits():
    big = grammar_limits.MAX_GRAMMAR_CHARS + 1
    with pytest.raises(GrammarError, match=f"the regex has {big} characters"):
        regex_grammar("a" * big)
    with pytest.raises(GrammarError, match=f"the grammar has {big} characters"):
        lark_grammar('start: "' + "a" * (big - 9) + '"')
    with pytest.raises(GrammarError, match="choices; the limit"):
        choice_grammar(["x"] * (grammar_limits.MAX_CHOICES + 1))


def test_a_deep_grammar_compiles_on_the_deep_stack():
    """3,000 chained rules (past the limit, so built with llguidance directly) compile through
    `GrammarTokenizer.matcher` from the main thread; on an 8 MiB stack they segfault."""
    code = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import tempfile, pathlib
import llguidance as llg
from tokenizers import Tokenizer
from tiny_models import make_tokenizer
from tallow.runtime.constraint import grammar_tokenizer
folder = pathlib.Path(tempfile.mkdtemp())
make_tokenizer(folder, 320)
tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
text = {chained_rules(3000)!r}
matcher = grammar_tokenizer(tok, 320, [2]).matcher(llg.LLMatcher.grammar_from_lark(text))
assert not matcher.is_dead_end
print("compiled")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "compiled" in p.stdout, (p.returncode, p.stderr[-2000:])


# -- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    s = start_process([sys.executable, str(HERE / "qwen_fake_serve.py"), "0.02"])
    yield s
    s.proc.terminate()
    s.proc.wait(30)


def _stream_to_the_end(base: str, result: dict) -> None:
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    result["finish"] = [c["finish_reason"] for e in events for c in e["choices"]][-1]


def test_grammars_past_the_limits_are_400s_and_streams_in_flight_finish(server):
    base = server.base_url
    result: dict = {}
    streaming = threading.Thread(target=_stream_to_the_end, args=(base, result))
    streaming.start()
    refs = chained_refs(3000)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": refs}}
    requests = [
        ("/v1/chat/completions", {"guided_grammar": chained_rules(3000)}, "guided_grammar"),
        ("/v1/chat/completions", {"guided_json": refs}, "guided_json"),
        ("/v1/chat/completions", {"response_format": fmt}, "response_format"),
        ("/v1/completions", {"prompt": "x", "guided_json": json.dumps(refs)}, "guided_json"),
    ]
    for route, extra, param in requests:
        body = {"model": MODEL, "max_tokens": 4, **extra}
        if route.endswith("chat/completions"):
            body["messages"] = CHAT
        r = httpx.post(base + route, json=body, timeout=120)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "the limit is 1000" in error["message"]
    text_format = {"type": "json_schema", "name": "x", "schema": refs}
    body = {"model": MODEL, "input": "Spell it.", "text": {"format": text_format}}
    r = httpx.post(f"{base}/v1/responses", json=body, timeout=120)
    assert r.status_code == 400 and "the limit is 1000" in r.json()["error"]["message"]
    streaming.join(120)
    assert result.get("finish") == "length"
    assert server.proc.poll() is None
    # A grammar at the limit is served: 998 rules deep, its output is a run of "a".
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 6,
        "guided_grammar": chained_rules(MAX_GRAMMAR_RULES - 2),
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text and set(text) == {"a"}
    assert httpx.get(f"{base}/health").status_code == 200
