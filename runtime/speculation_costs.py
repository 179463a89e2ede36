"""What a verification costs on this model and device, measured when the engine starts.

`SpeculationPolicy` weighs each proposal's expected tokens against the rows it adds to the
step. A fixed guess of those costs was wrong by far for larger models on the CPU: for a
SmolLM2-1.7B-shaped Q4_K_M file (2 threads, AMD Zen 3) one sequence's decode step took 100
ms, but the same sequence verifying 1 proposal took 278 ms and 5 proposals 355 ms, because
a lone sequence decodes through `decode`'s one-row kernels while several rows go through
`batch_decode`'s tiles, which cost 2.3-2.6x as much per weight at one or two rows when the
weights come from memory (`benchmarks/decode_matmul.py --cold`, q4k 16384 x 2048: 1.67 ms
against 3.85 / 4.33 ms). On SmolLM2-135M the three steps are 11.2, 12.5 and 19.7 ms. So
the engine times the three forwards on a scratch sequence (a few hundred milliseconds for
small models, seconds for 8B ones on a CPU) and gives the policy:

* `row_cost`: one more row of a multi-row forward, relative to that forward's fixed cost;
* `single_cost`: one sequence's plain decode step, in the same unit (below 1 + row_cost
  where `decode`'s kernels are the cheaper ones, as above).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

SCRATCH_SEQ = 2**31 - 7  # an id no request gets: the engine numbers its sequences from 0
CONTEXT = 64  # tokens in the scratch sequence before the timed steps


@dataclass(frozen=True)
class StepCosts:
    single_ms: float  # one token of one sequence (`decode`)
    two_ms: float  # two tokens of one sequence, every row's logits (a verification of 1)
    many_ms: float  # `many` tokens of one sequence, every row's logits
    many: int

    @property
    def per_row_ms(self) -> float:
        return max((self.many_ms - self.two_ms) / (self.many - 2), 0.0)

    @property
    def fixed_ms(self) -> float:
        return self.two_ms - 2 * self.per_row_ms

    def relative(self) -> tuple[float, float] | None:
        """(row_cost, single_cost), or None where the timings make no sense (a fixed cost
        at or below zero: a machine too noisy to tell)."""
        if self.many <= 2 or self.fixed_ms <= 0 or self.single_ms <= 0:
            return None
        return self.per_row_ms / self.fixed_ms, self.single_ms / self.fixed_ms


def measure_step_costs(runner, max_proposals: int, reps: int = 3) -> StepCosts:
    """The best of `reps` timings of the three forwards, after one of each to warm up, on a
    scratch sequence that is removed afterwards (nothing stays in the cache)."""
    many = max(max_proposals + 1, 3)
    runner.add_sequence(SCRATCH_SEQ)
    try:
        runner.forward([(SCRATCH_SEQ, list(range(1, CONTEXT + 1)))])

        def best(tokens: int) -> float:
            times = []
            for _ in range(reps + 1):
                t = time.perf_counter()
                runner.forward([(SCRATCH_SEQ, [1] * tokens)], None if tokens == 1 else [tokens])
                times.append(time.perf_counter() - t)
                runner.popn(SCRATCH_SEQ, tokens)
            return 1000 * min(times[1:])

        return StepCosts(best(1), best(2), best(many), many)
    finally:
        runner.remove_sequence(SCRATCH_SEQ)


def calibrated(spec, runner):
    """`spec` (a SpeculativeConfig) with the measured costs; as it is where they make no
    sense."""
    import dataclasses

    costs = measure_step_costs(runner, spec.num_speculative_tokens)
    relative = costs.relative()
    summary = (
        f"speculation: a decode step {costs.single_ms:.1f} ms, verifying 1 proposal "
        f"{costs.two_ms:.1f} ms, {costs.many - 1} proposals {costs.many_ms:.1f} ms"
    )
    if relative is None:
        log.warning("%s: no cost model fits; keeping the defaults", summary)
        return spec
    row_cost, single_cost = relative
    log.info("%s (row cost %.3f, single step %.2f)", summary, row_cost, single_cost)
    return dataclasses.replace(spec, row_cost=row_cost, single_cost=single_cost)
