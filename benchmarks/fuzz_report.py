"""What the fuzz campaign (benchmarks/fuzz_server.py) saw, its pass criteria, its tables, and
its findings, each with the request that led to it (bodies cut to 2 KB, with their size)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz_case import Case

STALL_S = 1.0
# 429 queue_full is a right answer to any request while the queue is full (it is counted in
# the tables; a large embeddings request locking others out shows as a burst of them, and as
# refused streams).
QUEUE_FULL = frozenset({429})
BODY_SHOWN = 2048


@dataclass(eq=False)
class Outcome:
    case: Case
    epoch: int = 0
    t0: float = 0.0
    t1: float = 0.0
    status: int | None = None
    error: str | None = None  # no answer: a transport error or a timeout
    left: bool = False  # the client left on purpose before the answer
    lost_in_crash: bool = False
    stream_error: str | None = None  # an engine failure or a stream cut short, inside a 200
    check: str | None = None  # a Schemathesis check that failed


GRAMMAR_ERROR = re.compile(r'"finish_reason":\s*"grammar_error"')


def answer_problem(
    text: str, path: str, event_stream: bool, satisfiable: bool = True
) -> str | None:
    """What is wrong inside a 200: an engine failure (an error event, a choice finished with
    "grammar_error": the engine could not continue a grammar it had accepted) or a stream
    without its proper end. "grammar_error" counts only where the constraint can be met by
    construction (tallow's own cases): Schemathesis' random regexes may not be, for this
    vocabulary (llguidance 1.9.1 offers the bytes of an unassigned character such as U+8735A,
    then refuses them: a dead end it documents as "grammar_error")."""
    if satisfiable and GRAMMAR_ERROR.search(text):
        return 'finish_reason "grammar_error"'
    return sse_problem(text, path) if event_stream else None


def sse_problem(text: str, path: str) -> str | None:
    """What is wrong with a 200 event stream: an error event, or no proper end."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            try:
                events.append(json.loads(line[6:]))
            except ValueError:
                return f"an event that is not JSON: {line[:120]}"
    for e in events:
        if "error" in e and e["error"]:
            return f"error event: {json.dumps(e['error'])[:200]}"
        if e.get("type") in ("error", "response.failed"):
            return f"{e['type']} event: {json.dumps(e)[:200]}"
    if path == "/v1/responses":
        last = events[-1].get("type") if events else None
        ok = last in ("response.completed", "response.incomplete")
        return None if ok else f"stream ended after {last!r}"
    return None if text.rstrip().endswith("data: [DONE]") else "stream ended without [DONE]"


def request_text(case: Case) -> dict[str, Any]:
    raw = case.payload()
    shown = raw[:BODY_SHOWN].decode("utf-8", "replace")
    return {
        "method": case.method,
        "path": case.path,
        "bytes": len(raw),
        "body": shown,
        "headers": case.headers,
        "kind": case.kind,
        "item": case.item,
    }


@dataclass
class Report:
    requests: int
    outcomes: list[Outcome] = field(default_factory=list)
    crashes: list[dict[str, Any]] = field(default_factory=list)
    solo_ok: bool = False
    stream_runs: Counter = field(default_factory=Counter)
    stream_diffs: list[dict[str, Any]] = field(default_factory=list)
    stream_errors: list[str] = field(default_factory=list)
    stream_refusals: Counter = field(default_factory=Counter)
    health: Any = None  # live_server.HealthProbe
    kv_pages_end: int | None = None
    exit_code: int | None = None
    wall_s: float = 0.0
    batch_invariance_unchecked: bool = False
    t_start: float = field(default_factory=time.monotonic)

    def add(self, out: Outcome) -> None:
        self.outcomes.append(out)
        if len(self.outcomes) % 500 == 0:
            bad = len(self.five_xx()), len(self.crashes)
            print(
                f"{len(self.outcomes)} requests sent; 5xx {bad[0]}, crashes {bad[1]}",
                file=sys.stderr,
                flush=True,
            )

    def add_crash(self, code: int, in_flight: list[Case], stderr_tail: str) -> None:
        self.crashes.append(
            {
                "at_s": round(time.monotonic() - self.t_start, 2),
                "exit_code": code,
                "stderr_tail": stderr_tail,
                "in_flight": [request_text(c) for c in in_flight],
            }
        )

    # -- judging -------------------------------------------------------------------------

    def five_xx(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status is not None and o.status >= 500]

    def unexpected(self) -> list[Outcome]:
        return [
            o
            for o in self.outcomes
            if o.status is not None
            and o.case.expect is not None
            and o.status not in o.case.expect | QUEUE_FULL
            and not o.left
        ]

    def no_answer(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None and not o.case.may_reset]

    def failures(self) -> list[str]:
        f = []
        counts = {
            "5xx answers": len(self.five_xx()),
            "crashes": len(self.crashes),
            "requests without an answer": len(self.no_answer()),
            "unexpected statuses": len(self.unexpected()),
            "failures inside 200 answers": sum(o.stream_error is not None for o in self.outcomes),
            "Schemathesis check failures": sum(o.check is not None for o in self.outcomes),
            "well-formed streams unlike their solo run": len(self.stream_diffs),
            "well-formed streams that failed": len(self.stream_errors),
        }
        f += [f"{n} {what}" for what, n in counts.items() if n]
        if not self.solo_ok:
            f.append("the solo runs of the 8 streams did not complete")
        if min((self.stream_runs.get(i, 0) for i in range(8)), default=0) < 1:
            f.append("a well-formed stream never completed during the run")
        if self.health is not None and self.health.worst_s > STALL_S:
            f.append(f"/health took {self.health.worst_s:.2f} s (limit {STALL_S} s)")
        if self.kv_pages_end:
            f.append(f"{self.kv_pages_end} KV pages still in use at the end")
        return f

    def passed(self) -> bool:
        return not self.failures()

    # -- output --------------------------------------------------------------------------

    def findings(self) -> list[dict[str, Any]]:
        out = []
        unexpected = {id(o) for o in self.unexpected()}
        for o in self.outcomes:
            what = []
            if o.status is not None and o.status >= 500:
                what.append(f"status {o.status}")
            if id(o) in unexpected:
                what.append(f"status {o.status}, expected {sorted(o.case.expect or [])}")
            if o.error is not None and not o.case.may_reset:
                what.append(f"no answer: {o.error}")
            if o.stream_error:
                what.append(o.stream_error)
            if o.check:
                what.append(f"schemathesis: {o.check}")
            if what:
                at = round(o.t0 - self.t_start, 2)
                out.append(
                    {"finding": "; ".join(what), "at_s": at, "request": request_text(o.case)}
                )
        for c in self.crashes:
            out.append({"finding": f"crash (exit {c['exit_code']})", **c})
        for start, latency in self.health.stalls if self.health else []:
            out.append({"finding": f"/health took {latency:.2f} s", **self._during(start, latency)})
        for latency, start in self.health.slowest if self.health else []:
            # not a failure: where the slowest probes (under the limit too) met what
            out.append({"note": f"/health took {latency:.2f} s", **self._during(start, latency)})
        out += [{"finding": "stream differs from its solo run", **d} for d in self.stream_diffs]
        out += [{"finding": e} for e in self.stream_errors]
        return out

    def _during(self, start: float, latency: float) -> dict[str, Any]:
        during = [o for o in self.outcomes if o.t0 <= start + latency and o.t1 >= start]
        return {
            "at_s": round(start - self.t_start, 2),
            "in_flight": dict(Counter(o.case.kind for o in during)),
            "largest": max((len(o.case.payload()) for o in during), default=0),
        }

    def status_table(self) -> str:
        routes = sorted({o.case.path for o in self.outcomes})
        statuses = sorted({o.status for o in self.outcomes if o.status is not None and not o.left})
        head = f"{'route':<22}" + "".join(f"{s:>6}" for s in statuses)
        head += f"{'left':>6}{'none':>6}{'crash':>6}"
        rows = [head]
        for r in routes:
            mine = [o for o in self.outcomes if o.case.path == r]
            c = Counter(o.status for o in mine if not o.left and o.status is not None)
            row = f"{r:<22}" + "".join(f"{c.get(s, 0):>6}" for s in statuses)
            row += f"{sum(o.left for o in mine):>6}{sum(o.error is not None for o in mine):>6}"
            row += f"{sum(o.lost_in_crash for o in mine):>6}"
            rows.append(row)
        return "\n".join(rows)

    def render(self) -> str:
        h = self.health
        lines = [
            f"{len(self.outcomes)} requests in {self.wall_s:.0f} s; statuses per route "
            "(left: the client left on purpose; none: no answer; crash: lost in a crash)",
            self.status_table(),
            "",
            f"5xx: {len(self.five_xx())}   crashes: {len(self.crashes)}   "
            f"unexpected statuses: {len(self.unexpected())}   no answer: {len(self.no_answer())}",
            f"/health: worst {h.worst_s * 1e3:.0f} ms over {h.probes} probes, "
            f"{len(h.stalls)} over {STALL_S} s"
            if h
            else "/health: not probed",
            "streams: "
            + ", ".join(f"{self.stream_runs.get(i, 0)}" for i in range(8))
            + f" runs; {len(self.stream_diffs)} differ from solo; {len(self.stream_errors)} failed;"
            + f" refused {dict(self.stream_refusals)}",
            f"KV pages in use at the end: {self.kv_pages_end}   "
            f"server exit status: {self.exit_code}",
        ]
        if self.batch_invariance_unchecked:
            lines.append("the server warned that batch invariance is not checked for this artifact")
        fails = self.failures()
        lines.append("PASS" if not fails else "FAIL: " + "; ".join(fails))
        return "\n".join(lines)

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "findings.jsonl", "w") as f:
            for item in self.findings():
                f.write(json.dumps(item) + "\n")
        summary = {
            "requests": len(self.outcomes),
            "status_table": self.status_table(),
            "by_kind": {
                k: dict(Counter(str(o.status) for o in self.outcomes if o.case.kind == k))
                for k in sorted({o.case.kind for o in self.outcomes})
            },
            "failures": self.failures(),
            "health_worst_s": self.health.worst_s if self.health else None,
            "stream_runs": dict(self.stream_runs),
            "kv_pages_end": self.kv_pages_end,
        }
        (folder / "report.json").write_text(json.dumps(summary, indent=1))
