"""Schemathesis' half of the fuzz campaign: cases drawn from the live OpenAPI document of
every route (positive and negative data), steered just enough to reach the engine, and the
checks that judge their responses against that document.

Cases are drawn before the run in one Hypothesis run per operation (about 50 ms a case on
2 cores; `strategy.example()` costs three times as much). Steering: most bodies get the
served `model` (a random name is a 404 that stops at the first line of every route), and
the token counts are capped so that a valid request cannot ask a 135M model on 2 cores for
thousands of tokens. A steered case no longer has Schemathesis' own idea of its validity, so
`negative_data_rejection` judges only cases left as drawn.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import schemathesis
from fuzz_case import Case
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import Failure, FailureGroup

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_STEERED_TOKENS = 16
# Routes whose bodies generate text: a body without a token count gets one.
GENERATING = {
    "/v1/chat/completions": "max_tokens",
    "/v1/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
}


def draw_cases(openapi_url: str, count: int, seed: int) -> list[Any]:
    """`count` Schemathesis cases spread evenly over the document's operations and over
    positive and negative data (GET routes without parameters have one positive case)."""
    schema = schemathesis.openapi.from_url(openapi_url)
    ops = [result.ok() for result in schema.get_all_operations()]
    strategies = []
    for op in ops:
        strategies.append((op, GenerationMode.POSITIVE))
        if op.body:
            strategies.append((op, GenerationMode.NEGATIVE))
    per = max(1, count // len(strategies))
    cases: list[Any] = []
    for op, mode in strategies:
        drawn: list[Any] = []

        @settings(
            max_examples=per,
            database=None,
            phases=[Phase.generate],
            deadline=None,
            derandomize=False,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.data())
        def collect(data: st.DataObject) -> None:
            drawn.append(data.draw(op.as_strategy(generation_mode=mode)))  # noqa: B023

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            collect()
        while drawn and len(drawn) < per:  # a small space (a GET): repeat what there is
            drawn.append(drawn[len(drawn) % max(1, len(drawn))])
        cases += drawn
    random.Random(seed).shuffle(cases)
    return cases[:count]


def to_case(st_case: Any, model: str, rng: random.Random) -> Case:
    """A Schemathesis case as the harness sends it, steered (see the module docstring)."""
    body = st_case.body
    steered = False
    if isinstance(body, dict):
        body = dict(body)
        if rng.random() < 0.8:
            body["model"] = model
            steered = True
        for name in TOKEN_FIELDS:
            value = body.get(name)
            if (
                isinstance(value, int)
                and not isinstance(value, bool)
                and value > MAX_STEERED_TOKENS
            ):
                body[name] = rng.randint(1, MAX_STEERED_TOKENS)
                steered = True
        path = st_case.operation.path
        # null counts as absent: chat then generates up to 4,096 tokens
        if path in GENERATING and not any(body.get(name) is not None for name in TOKEN_FIELDS):
            body[GENERATING[path]] = rng.randint(1, MAX_STEERED_TOKENS)
            steered = True
        st_case.body = body
    label = f"schemathesis:{st_case.meta.generation.mode.value}" if st_case.meta else "schemathesis"
    checks = CHECKS + ([negative_data_rejection] if not steered else [])
    case = Case(label, st_case.method.upper(), st_case.operation.path)
    if isinstance(body, (bytes, str)):  # a negative case's body that is not JSON at all
        case.raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    elif isinstance(body, (dict, list, int, float, bool)) or body is None:
        case.body = body
    case.schemathesis, case.checks = st_case, checks
    headers = dict(st_case.headers or {})
    headers.setdefault("Content-Type", "application/json")
    case.headers = headers
    return case


def check(case: Case, response: Any) -> str | None:
    """What Schemathesis' checks found wrong with `response`; None when nothing."""
    try:
        case.schemathesis.validate_response(response, checks=case.checks)
    except (Failure, FailureGroup) as e:
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        return text[:400] or type(e).__name__
    return None
