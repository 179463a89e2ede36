"""One request of the fuzz campaign (benchmarks/fuzz_server.py), as its generators make it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
EMBEDDINGS, TOKENIZE, DETOKENIZE = "/v1/embeddings", "/tokenize", "/detokenize"
OK, BAD = frozenset({200}), frozenset({400})


@dataclass
class Case:
    kind: str  # the generator that made it (a table row of the report)
    method: str
    path: str
    body: Any = None  # a JSON value (json.dumps: lone surrogates go out as \\u escapes)
    raw: bytes | None = None  # sent as is instead of `body`
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    leave_after: float | None = None  # the client disconnects after this many seconds
    expect: frozenset[int] | None = None  # None: any status but a 5xx
    # The issue-33 item the case probes (a regression check); capped per run, as they cost.
    item: int | None = None
    schemathesis: Any = None  # a Schemathesis case, whose `checks` judge the response
    checks: list[Any] = field(default_factory=list)
    may_reset: bool = False  # a body past the limit: the server may close before reading it
    costly: bool = False  # seconds of server time (a full context window, megabytes of text)

    def payload(self) -> bytes:
        if self.raw is not None:
            return self.raw
        return b"" if self.body is None else json.dumps(self.body).encode()

    def streams(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True
