"""After the forward: sample the rows that need it, advance grammars, stream the deltas.

Constrained rows sample on the host from their grammar mask. A grammar that is complete
finishes its sequence with "stop"; one that cannot go on (no token allowed, or the matcher
errored) with "grammar_error", without sampling. An n > 1 fork clones its parent's matcher; a
preempted sequence keeps its own.

Failures. What goes wrong for one sequence (its sampling parameters, its grammar matcher, its
detokenizer or stop handling, the postprocessing of its row) fails that request alone: its
sink gets the error, its KV is freed, and every other sequence of the step carries on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from tallow.runtime.completion_stream import CompletionStream
from tallow.runtime.constraint import GRAMMAR_ERROR, disallow_tokens
from tallow.runtime.request import (
    CompletionDelta,
    FinishReason,
    ScheduledItem,
    SequenceState,
    TokenLogprob,
)
from tallow.runtime.request_table import RequestTable
from tallow.runtime.scheduler import Scheduler
from tallow.runtime.speculative import SpeculativeRuns, VerifiedRun, merge_deltas
from tallow.runtime.step_sampling import Histories, StepSampler

log = logging.getLogger(__name__)

Sampled = tuple[CompletionStream, int, TokenLogprob | None]


class StepPostprocessor:
    """Turns a step's logits into tokens and outputs for the requests in `table`."""

    def __init__(
        self,
        table: RequestTable,
        scheduler: Scheduler,
        sampling: StepSampler,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.table = table
        self.scheduler = scheduler
        self.sampling = sampling
        self.eos_token_ids = eos_token_ids
        self.generated_tokens = 0

    def run(
        self,
        items: Sequence[ScheduledItem],
        logits: Any,
        masks: dict[int, np.ndarray] | None = None,
        failed: dict[str, BaseException] | None = None,
        more: Sequence[tuple[Sequence[ScheduledItem], Any]] = (),
    ) -> None:
        """Sample the rows that need it and stream the results. `failed` (request id ->
        error) collects the requests something went wrong for; they fail at the end, alone.
        `more`: the step's other (items, logits) batches (prompt-scoring chunks, whose rows
        come from their own forward)."""
        masks = masks or {}
        failed = {} if failed is None else failed
        per_request: dict[str, list[CompletionDelta]] = {}
        sampled: list[Sampled] = []
        runs = SpeculativeRuns()
        for batch, batch_logits in [(items, logits), *more]:
            entries = self._rows_to_sample(batch, masks, failed, per_request, runs)
            sampled += self._sample(batch_logits, *entries, failed)
        for st, token, lp in sampled:
            rid = st.seq.request.request_id
            if rid in failed:
                continue
            if runs.collect(st, token, lp):
                continue  # a verified item's rows: accepted together below
            try:
                delta = self._accept(st, token, lp)
            except Exception as e:  # noqa: BLE001 - e.g. its detokenizer or stop strings
                failed[rid] = e
                continue
            per_request.setdefault(rid, []).append(delta)
        for st, run in runs.ready():
            rid = st.seq.request.request_id
            if rid in failed:
                continue
            try:
                delta = self._accept_run(st, run)
            except Exception as e:  # noqa: BLE001 - as above
                failed[rid] = e
                continue
            per_request.setdefault(rid, []).append(delta)
        for rid, deltas in per_request.items():
            if rid not in failed:
                self.table.emit(self.table.requests[rid], deltas)
        for rid, error in failed.items():
            self.table.fail(rid, error)

    def _rows_to_sample(
        self,
        items: Sequence[ScheduledItem],
        masks: dict[int, np.ndarray],
        failed: dict[str, BaseException],
        per_request: dict[str, list[CompletionDelta]],
        runs: SpeculativeRuns,
    ) -> tuple[list[int], list[CompletionStream], list[np.ndarray | None], list[list[int]]]:
        """The (row, stream, mask, proposals before the row) of every stream that samples
        from `items`' rows; streams that end here instead (a grammar's end, max_tokens 0) are
        retired into `per_request`. A verified item samples each of its rows (`runs`)."""
        rows: list[int] = []
        states: list[CompletionStream] = []
        row_masks: list[np.ndarray | None] = []
        before: list[list[int]] = []
        first = 0  # the item's first logits row
        for item in items:
            row, first = first + item.num_logits - 1, first + item.num_logits
            if not item.sample:
                continue  # a prefill chunk short of the prompt's end: its logits are unused
            if item.proposals and item.seq.request.request_id not in failed:
                st = self.table.by_seq[item.seq.seq_id]
                try:
                    mask = masks.get(item.seq.seq_id)
                    ended = self._ends_unsampled(st, mask)
                    if ended is not None:  # its grammar is done: no row samples
                        delta = self.table.retire(st, st.finish(ended))
                        per_request.setdefault(st.seq.request.request_id, []).append(delta)
                        continue
                    spec_masks = self._proposal_masks(st, item.proposals, mask)
                except Exception as e:  # noqa: BLE001 - this request fails, the step goes on
                    failed[st.seq.request.request_id] = e
                    continue
                runs.add(st, item.proposals)
                for j, m in enumerate(spec_masks):
                    rows.append(row - len(item.proposals) + j)
                    states.append(st)
                    row_masks.append(m)
                    before.append(item.proposals[:j])
                continue
            seq = item.seq
            rid = seq.request.request_id
            if rid in failed:
                continue
            try:
                group = self._sampling_group(seq)
                mask = masks.get(seq.seq_id)
                for st in group:
                    ended = self._ends_unsampled(st, mask)
                    if ended is not None:
                        delta = self.table.retire(st, st.finish(ended))
                        per_request.setdefault(rid, []).append(delta)
                        continue
                    rows.append(row)
                    states.append(st)
                    row_masks.append(mask if st.matcher is not None else None)
                    before.append([])
            except Exception as e:  # noqa: BLE001 - this request fails, the step goes on
                failed[rid] = e
        return rows, states, row_masks, before

    def _ends_unsampled(self, st: CompletionStream, mask: np.ndarray | None) -> FinishReason | None:
        """Why a stream ends before sampling (None: it samples): max_tokens 0 (a prompt
        scored, nothing generated) or its grammar."""
        if st.seq.request.params.max_tokens == 0:
            return "length"
        if st.matcher is not None:
            return self._grammar_end(st, mask)
        return None

    def _sampling_group(self, seq: SequenceState) -> list[CompletionStream]:
        """The streams that sample from `seq`'s row: itself, plus its n > 1 siblings at the
        end of the prompt's prefill (they fork off it here)."""
        group = [self.table.by_seq[seq.seq_id]]
        if seq.pending_forks:
            # n > 1: the prompt was prefilled once; the siblings share its KV and sample
            # their first token from the same logits row (and mask: a fork's matcher is a
            # copy of its parent's, which has consumed nothing yet).
            req_state = self.table.requests[seq.request.request_id]
            parent = group[0].matcher
            for child in self.scheduler.fork_children(seq):
                matcher = parent.clone() if parent is not None else None
                group.append(self.table.track(req_state, child, matcher))
        return group

    def _sample(
        self,
        logits: np.ndarray | None,
        rows: list[int],
        states: list[CompletionStream],
        row_masks: list[np.ndarray | None],
        before: list[list[int]],
        failed: dict[str, BaseException],
    ) -> list[Sampled]:
        """One token per stream. If the batched call raises, each stream is sampled on its
        own, so only the request whose row cannot be sampled fails (into `failed`)."""
        if not states:
            return []
        assert logits is not None

        def run(idx: list[int]) -> list[Sampled]:
            sts = [states[i] for i in idx]
            ms = [row_masks[i] for i in idx]
            sampled = self.sampling.sample(
                logits,
                [rows[i] for i in idx],
                [st.seq.request.params for st in sts],
                [st.generator for st in sts],
                Histories([st.seq for st in sts], prompt=True),
                Histories([st.seq for st in sts], prompt=False, extra=[before[i] for i in idx]),
                ms if any(m is not None for m in ms) else None,
            )
            result = []
            for j, st in enumerate(sts):
                token, logprob = int(sampled.token_ids[j]), sampled.logprobs[j]
                lp = (
                    None
                    if logprob is None
                    else TokenLogprob(token, logprob, sampled.top_logprobs[j])
                )
                result.append((st, token, lp))
            return result

        try:
            return run(list(range(len(states))))
        except Exception:  # noqa: BLE001 - find the row(s) that raise
            log.warning("batched sampling failed; sampling each sequence on its own")
        result = []
        for i, st in enumerate(states):
            rid = st.seq.request.request_id
            if rid in failed:
                continue
            try:
                result += run([i])
            except Exception as e:  # noqa: BLE001 - fails this request only
                failed[rid] = e
        return result

    def _proposal_masks(self, st: CompletionStream, proposals: list[int], first) -> list:
        """The mask of each verified row: the grammar's after the proposals before it (all
        None without one). Rows after a proposal that completes or closes the grammar are not
        sampled: the run ends there, and the next step finishes the sequence."""
        matcher = st.matcher
        if matcher is None:
            return [None] * (1 + len(proposals))
        out, consumed = [first], 0
        try:
            for token in proposals:
                if not matcher.accept(token):
                    break
                consumed += 1
                if matcher.is_finished or matcher.is_dead_end:
                    break
                mask = matcher.tokenizer.empty_masks(1)[0]
                matcher.fill_mask(mask)
                if st.seq.request.params.ignore_eos:
                    disallow_tokens(mask, matcher.tokenizer.eos_token_ids)
                if not mask.any():
                    break
                out.append(mask)
        finally:
            matcher.rollback(consumed)
        return out

    def _grammar_end(self, st: CompletionStream, mask: np.ndarray | None) -> FinishReason | None:
        """Why a constrained sequence ends before sampling (None: it samples from `mask`)."""
        matcher = st.matcher
        assert matcher is not None
        if matcher.is_dead_end:
            return GRAMMAR_ERROR
        if matcher.is_finished:
            return "stop"  # e.g. a grammar whose only sentence is empty
        if mask is None:
            raise RuntimeError(f"no grammar mask was computed for sequence {st.seq.seq_id}")
        if st.seq.request.params.ignore_eos:
            disallow_tokens(mask, matcher.tokenizer.eos_token_ids)
        if not mask.any():
            return GRAMMAR_ERROR
        return None

    def _accept(self, st: CompletionStream, token: int, lp: TokenLogprob | None) -> CompletionDelta:
        """Append a sampled token, count it, and retire its sequence if it finished."""
        return self.table.retire(st, self._append(st, token, lp))

    def _append(self, st: CompletionStream, token: int, lp: TokenLogprob | None) -> CompletionDelta:
        state = self.table.requests[st.seq.request.request_id]
        state.completion_tokens += 1
        self.generated_tokens += 1
        return st.accept(token, lp, self.eos_token_ids)

    def _accept_run(self, st: CompletionStream, run: VerifiedRun) -> CompletionDelta:
        """A verified item: its sampled tokens while they equal the proposals, plus the one
        after (`speculative.py`), as one delta; the rejected proposals leave the KV cache
        and the stream's generator is left as if only the emitted tokens had drawn."""
        deltas, accepted = [], 0
        for j, (token, lp) in enumerate(run.sampled):
            deltas.append(self._append(st, token, lp))
            matched = j < len(run.proposals) and token == run.proposals[j]
            accepted += matched
            if deltas[-1].finish_reason is not None or not matched:
                break
        self.scheduler.commit_speculation(st.seq, len(deltas) - 1)
        if self.scheduler.speculation is not None:
            self.scheduler.speculation.record(st.seq.seq_id, len(run.proposals), accepted)
        run.rewind(st.generator, len(deltas))
        return self.table.retire(st, merge_deltas(deltas))
