"""Fair prefill: the order in which requests share one step's prefill token budget.

The scheduler groups the sequences with prefill work (running ones part-way through their
prompt, then waiting ones in queue order) by request: a multi-prompt API request's engine
requests share a `Request.group`, and the n > 1 siblings of one prompt share their `Request`.
Groups take turns round-robin (lower `SamplingParams.priority` first), so a short request
arriving behind a huge one is prefilled within a step or two instead of after all of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tallow.runtime.request import SequenceState


@dataclass
class PrefillGroup:
    key: str
    priority: int
    prefilling: list[SequenceState] = field(default_factory=list)  # running, oldest first
    waiting: list[SequenceState] = field(default_factory=list)  # queue order


class RoundRobin:
    """The turn order of the groups; the one first this step goes last the next."""

    def __init__(self) -> None:
        self._ring: list[str] = []

    def groups(
        self, prefilling: Iterable[SequenceState], waiting: Iterable[SequenceState]
    ) -> list[PrefillGroup]:
        by_key: dict[str, PrefillGroup] = {}

        def group(s: SequenceState) -> PrefillGroup:
            r = s.request
            g = by_key.get(r.fair_key)
            if g is None:
                g = by_key[r.fair_key] = PrefillGroup(r.fair_key, r.params.priority)
            g.priority = min(g.priority, r.params.priority)
            return g

        for s in prefilling:
            group(s).prefilling.append(s)
        for s in waiting:
            group(s).waiting.append(s)
        # Keep the turns of the groups still present; newcomers join at the back.
        ring = [k for k in self._ring if k in by_key]
        seen = set(ring)
        ring += [k for k in by_key if k not in seen]
        self._ring = ring
        turn = {k: i for i, k in enumerate(ring)}
        return sorted(by_key.values(), key=lambda g: (g.priority, turn[g.key]))

    def rotate(self) -> None:
        if self._ring:
            self._ring.append(self._ring.pop(0))
