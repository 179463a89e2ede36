"""Speculative decoding: propose tokens cheaply, verify them in one forward, keep the agreeing run.

Decode reads every weight once per token. A forward over k+1 tokens of one sequence reads
them once too, so when k proposed tokens are often what the model would have produced,
several tokens come out of one weight read. Two proposers share the verification:

* `NgramProposer` (prompt lookup): the continuation of the longest earlier occurrence of the
  sequence's last n tokens, in its prompt or its output. Free to compute, and right most of
  the time where the answer quotes its input (rewrite this code, re-emit this JSON).
* `draft_proposer.DraftProposer`: a smaller model with the same vocabulary, decoding greedily
  with its own KV cache.

Verification (`step_postprocess.py`) samples every row of the verified item with the
request's own sampler and keeps proposals while the sampled token equals the proposal. For a
proposer that names one token per position, that is the standard rejection rule: a proposal
x survives with probability p(x), and a rejected position's sample is p conditioned on not
being x, i.e. norm(max(p - q, 0)) with q the point mass on x. Each emitted token uses one
draw of its stream's generator, as without speculation (`StepPostprocessor` rewinds the
draws of rejected rows), so a seeded request gives the same tokens with and without it, up
to the float rounding that differs between the verifying and the decoding kernels.

How many tokens to propose (`SpeculationPolicy`): a forward over R rows of a decode batch
costs about a + b*R (CPU, SmolLM2-135M Q4_1, one thread, Zen 3: a = 8.3 ms, b = 2.1 ms per
row, `benchmarks/speculative_decode.py`), and a lone sequence's plain decode step may run
cheaper kernels than that (a SmolLM2-1.7B shape: 100 ms against 278 ms for two rows); both
are measured when the engine starts (`speculation_costs`). Each sequence's acceptance rate
alpha (a decayed count of its own verified proposals) makes the j-th proposal of that
sequence worth alpha^j expected tokens. Proposals are taken most valuable first, as many
as give the step the most expected tokens per unit of cost: at batch 1 on SmolLM2-135M a
proposal pays from alpha^j above about 0.2, at batch 16 only near-certain ones do, on the
1.7B shape only 5 proposals at alpha 0.8 and more, and a sequence whose
proposals keep failing stops proposing (its alpha decays below the bar).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .request import SequenceState

# `--speculative` values
NGRAM = "ngram"
DRAFT = "draft"
KINDS = (NGRAM, DRAFT)


@dataclass(frozen=True)
class SpeculativeConfig:
    kind: str = NGRAM
    num_speculative_tokens: int = 5  # the most tokens proposed per sequence per step
    # prompt lookup: the longest and shortest suffix matched
    ngram_max: int = 4
    ngram_min: int = 2
    # Cost of one more row in a forward, relative to a forward's fixed cost (b / a above).
    row_cost: float = 0.25
    # Cost of proposing one token, in the same unit: 0 for prompt lookup; for a draft model
    # its weight bytes over the model's (decode reads them once per token).
    proposal_cost: float = 0.0
    # One sequence's plain decode step in the same unit, where it runs other (cheaper)
    # kernels than a forward of several rows; None: 1 + row_cost. Both measured at start
    # (`speculation_costs`).
    single_cost: float | None = None
    draft: str | None = None  # kind "draft": the draft artifact's folder

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"--speculative: one of {', '.join(KINDS)} (got {self.kind!r})")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"--num-speculative-tokens: between 1 and 16 (got {self.num_speculative_tokens})"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("ngram_min must be between 1 and ngram_max")
        if (self.kind == DRAFT) != (self.draft is not None):
            raise ValueError("--draft ARTIFACT goes with --speculative draft, and only with it")


class Proposer(Protocol):
    """Guesses the next tokens. A proposer may also have `propose_batch(seqs, ks)` (one call
    for the step's sequences: a draft model batches its forwards) and `forget(seq_id)`."""

    def propose(self, seq: SequenceState, k: int) -> list[int]:
        """Up to `k` tokens likely to follow `seq.token_ids`."""
        ...


class NgramProposer:
    """Prompt lookup: the tokens after the latest earlier match of the last n tokens."""

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, seq: SequenceState, k: int) -> list[int]:
        tokens = np.asarray(seq.token_ids, dtype=np.int64)
        length = tokens.size
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            suffix = tokens[length - n :]
            # windows starting at i < length - n (not the suffix itself), first token first
            starts = np.flatnonzero(tokens[: length - n] == suffix[0])
            for i in starts[::-1]:  # the latest match: its continuation is the freshest
                if np.array_equal(tokens[i : i + n], suffix):
                    follow = tokens[i + n : i + n + k]
                    if follow.size:
                        return [int(t) for t in follow]
        return []


@dataclass
class _Acceptance:
    """A sequence's decayed counts of verified proposals (alpha = accepted / tried)."""

    accepted: float = 1.0  # prior: alpha 0.5 until the sequence has shown its own rate
    tried: float = 2.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried

    def recover(self, rate: float) -> None:
        prior = _Acceptance()
        self.accepted += rate * (prior.accepted - self.accepted)
        self.tried += rate * (prior.tried - self.tried)


@dataclass
class SpeculationStats:
    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0  # sequence-steps that verified at least one proposal

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class SpeculationPolicy:
    """Which running sequences propose how many tokens this step (see the module doc)."""

    config: SpeculativeConfig
    proposer: Proposer
    decay: float = 0.8  # weight of the past per verification: alpha follows recent text
    # Per step a sequence does not propose, its counts move this much back to the prior, so
    # text that turns to quoting its input is tried again: about one proposal per 25 steps
    # after a failure (one extra row then; under 1% of chat's decode time on the CPU).
    recovery: float = 0.005
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    _acceptance: dict[int, _Acceptance] = field(default_factory=dict)

    def plan(self, decodes: Sequence[SequenceState], room: int) -> dict[int, list[int]]:
        """Proposals per seq_id for this step's decoding sequences, at most `room` tokens in
        all (the scheduler's token budget and free pages)."""
        k_max = self.config.num_speculative_tokens
        batch = len(decodes)
        candidates: list[tuple[SequenceState, int, float]] = []
        for s in decodes:
            k = min(k_max, self._room_in_sequence(s))
            if k <= 0:
                continue
            acc = self._acceptance.setdefault(s.seq_id, _Acceptance())
            plain = batch / self._cost(batch, 0)
            expected = np.cumsum([acc.alpha ** (j + 1) for j in range(k)])
            if not any(
                (batch + expected[n - 1]) / self._cost(batch, n) > plain for n in range(1, k + 1)
            ):
                acc.recover(self.recovery)  # not worth a row even alone: drift back, slowly
                continue
            candidates.append((s, k, acc.alpha))
        if not candidates:
            return {}
        propose_batch = getattr(self.proposer, "propose_batch", None)
        if propose_batch is not None:  # one draft forward per position for every sequence
            drafts = propose_batch([s for s, _, _ in candidates], [k for _, k, _ in candidates])
        else:
            drafts = {s.seq_id: self.proposer.propose(s, k) for s, k, _ in candidates}
        offers = [
            (alpha ** (j + 1), s.seq_id, j)
            for s, _, alpha in candidates
            for j in range(len(drafts.get(s.seq_id) or ()))
        ]
        offers.sort(key=lambda o: -o[0])
        # The most valuable offers first; keep the count that gives the most expected
        # tokens per unit of cost (with costs linear in rows that is where the next offer
        # would lower the rate; a lone sequence's cheaper `decode` step makes the first
        # proposals cost more than the next ones).
        tokens = float(batch)  # expected tokens of the step
        best_rate, best_n = tokens / self._cost(batch, 0), 0
        order: list[int] = []
        taken: dict[int, int] = {}
        for value, sid, j in offers:
            if len(order) >= room:
                break
            if j != taken.get(sid, 0):
                continue  # a sequence's proposals are taken in order (a prefix)
            taken[sid] = j + 1
            order.append(sid)
            tokens += value
            rate = tokens / self._cost(batch, len(order))
            if rate > best_rate:
                best_rate, best_n = rate, len(order)
        take: dict[int, int] = {}
        for sid in order[:best_n]:
            take[sid] = take.get(sid, 0) + 1
        return {sid: drafts[sid][:n] for sid, n in take.items()}

    def _cost(self, batch: int, proposals: int) -> float:
        """A step's cost, in units of a multi-row forward's fixed cost, for `batch` decoding
        sequences and `proposals` proposed tokens among them."""
        row = self.config.row_cost
        if batch == 1 and proposals == 0 and self.config.single_cost is not None:
            return self.config.single_cost
        return 1.0 + row * (batch + proposals) + self.config.proposal_cost * proposals

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verification's outcome: `accepted` of `proposed` proposals kept (a prefix)."""
        if proposed <= 0:
            return
        acc = self._acceptance.setdefault(seq_id, _Acceptance())
        # `accepted` successes; the first rejected position (if any) one failure.
        acc.accepted = acc.accepted * self.decay + accepted
        acc.tried = acc.tried * self.decay + accepted + (1 if accepted < proposed else 0)
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        self.stats.verify_steps += 1

    def forget(self, seq_id: int) -> None:
        self._acceptance.pop(seq_id, None)
        forget = getattr(self.proposer, "forget", None)
        if forget is not None:  # a draft model's cache holds the sequence
            forget(seq_id)

    @staticmethod
    def _room_in_sequence(s: SequenceState) -> int:
        """Proposals worth verifying for `s`: none past max_tokens (the last token emitted
        is always a sampled one), none for requests that opt out or have to see
        each token before the next (n > 1 forks not yet made)."""
        p = s.request.params
        if not p.speculative or s.pending_forks:
            return 0
        return p.max_tokens - s.num_output_tokens - 1


def merge_deltas(deltas):
    """One `CompletionDelta` for an accepted run (streamed as one chunk)."""
    first = deltas[0]
    if len(deltas) == 1:
        return first
    for d in deltas[1:]:
        first.token_ids += d.token_ids
        first.text += d.text
        if first.logprobs is not None and d.logprobs is not None:
            first.logprobs += d.logprobs
    last = deltas[-1]
    first.finish_reason = last.finish_reason
    first.stop_logprob = last.stop_logprob
    return first


@dataclass
class VerifiedRun:
    """One verified item's proposals and the tokens its rows sampled, in row order."""

    proposals: list[int]
    snapshot: dict | None  # its generator's state before the rows drew (None: greedy)
    sampled: list[tuple[int, object]] = field(default_factory=list)

    def rewind(self, generator: np.random.Generator | None, emitted: int) -> None:
        """Leave the generator as if only the `emitted` tokens' rows had drawn (one uniform
        each, as `Sampler` and the device path take): the next step's draw is then the one
        it would be without speculation."""
        if self.snapshot is None or generator is None:
            return
        generator.bit_generator.state = self.snapshot
        for _ in range(emitted):
            generator.random()


class SpeculativeRuns:
    """The verified items of one step, keyed by sequence, while their rows are sampled."""

    def __init__(self) -> None:
        self._runs: dict[int, tuple[object, VerifiedRun]] = {}

    def add(self, stream, proposals: list[int]) -> None:
        gen = stream.generator
        draws = gen is not None and stream.seq.request.params.temperature > 0
        snapshot = gen.bit_generator.state if draws else None
        self._runs[stream.seq.seq_id] = (stream, VerifiedRun(list(proposals), snapshot))

    def collect(self, stream, token: int, logprob) -> bool:
        """Keep a sampled row of a verified item (False: the stream is not one)."""
        entry = self._runs.get(stream.seq.seq_id)
        if entry is None:
            return False
        entry[1].sampled.append((token, logprob))
        return True

    def ready(self) -> list[tuple[object, VerifiedRun]]:
        return [entry for entry in self._runs.values() if entry[1].sampled]
