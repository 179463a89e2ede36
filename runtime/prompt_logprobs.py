"""Prompt logprobs inside the engine: scoring a prompt's own tokens at prefill.

A request with `SamplingParams.prompt_logprobs` (what `echo` with `logprobs` on /v1/completions
needs, and so what lm-evaluation-harness's loglikelihood requests use) needs the logits after
every prompt token, not only the last. Its prefill chunks run through the runner's
`forward_prompt_logits` in the same step as the other items' `forward` (as embeddings run
through `forward_hidden`); row j of a chunk starting at prompt position c predicts the token at
c + j + 1, so each chunk scores the prompt tokens after it on its own, and the chunk that ends
the prompt hands its last row back for sampling the first generated token on the host.

The scheduler admits such a request without a prefix-cache match (every token must be
computed). A preemption before the prompt is done restarts its scores with its prefill; after
that (the scores were sent with the first output) its recompute is an ordinary prefill.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tallow.runtime.model_runner_protocol import ModelExecutor
from tallow.runtime.request import ScheduledItem, SchedulerOutput, SequenceState, TokenLogprob
from tallow.runtime.request_table import RequestTable
from tallow.runtime.sampler import log_softmax


def needs_prompt_logits(item: ScheduledItem) -> bool:
    """A chunk of a prompt being scored: its every position's logits are wanted."""
    seq = item.seq
    return seq.request.scores_prompt and seq.num_output_tokens == 0


def score_rows(rows: np.ndarray, targets: list[int], top: int) -> list[TokenLogprob]:
    """Each target's logprob under its row (float32 log-softmax) and the row's `top` best;
    the target's value and the top values come from one array, so a target that is its
    row's most likely token has exactly the top logprob."""
    if not targets:
        return []
    lp = log_softmax(np.asarray(rows[: len(targets)], dtype=np.float32))
    picked = lp[np.arange(len(targets)), targets]
    out = []
    for i, token in enumerate(targets):
        best = None
        if top:
            idx = np.argpartition(-lp[i], top - 1)[:top]
            idx = idx[np.argsort(-lp[i, idx], kind="stable")]
            best = [(int(t), float(lp[i, t])) for t in idx]
        out.append(TokenLogprob(int(token), float(picked[i]), best))
    return out


class PromptScoring:
    """The step's prompt-scoring chunks: run, scored, and their sampling rows handed back
    (step-thread only)."""

    def __init__(self, runner: ModelExecutor, table: RequestTable) -> None:
        self.runner = runner
        self.table = table
        self._partial: dict[int, list[TokenLogprob | None]] = {}  # seq_id -> scores so far

    def split(self, out: SchedulerOutput) -> tuple[list[ScheduledItem], SchedulerOutput]:
        """The items that need every position's logits, and the output without them."""
        scored = [it for it in out.items if needs_prompt_logits(it)]
        if not scored:
            return [], out
        rest = [it for it in out.items if not needs_prompt_logits(it)]
        return scored, dataclasses.replace(out, items=rest)

    def run(self, items: list[ScheduledItem]) -> np.ndarray:
        """Run the chunks, score their prompt tokens, and return each item's last row
        ([len(items), vocab], host): the logits a chunk that ends the prompt samples from."""
        # Scores of sequences that failed or were aborted since the last scoring step go.
        self._partial = {k: v for k, v in self._partial.items() if k in self.table.by_seq}
        logits = self.runner.forward_prompt_logits([(it.seq.seq_id, it.token_ids) for it in items])
        last = np.empty((len(items), self.runner.vocab_size), dtype=np.float32)
        for row, (item, rows) in enumerate(zip(items, logits, strict=True)):
            rows = np.asarray(rows)
            last[row] = rows[-1]
            self._score(item.seq, len(item.token_ids), rows)
            if item.sample:  # the prompt is done: its scores go out with the first output
                state = self.table.requests[item.seq.request.request_id]
                state.prompt_logprobs = self._partial.pop(item.seq.seq_id)
        return last

    def _score(self, seq: SequenceState, fed: int, rows: np.ndarray) -> None:
        start = seq.num_computed_tokens - fed  # the scheduler has counted this chunk already
        if start == 0:  # the prompt prefills from its first token (again, after a preemption)
            self._partial[seq.seq_id] = [None]
        end = min(start + fed + 1, seq.prompt_len)  # targets: prompt tokens start+1 .. end-1
        targets = seq.token_ids[start + 1 : end]
        top = seq.request.params.prompt_logprobs or 0
        self._partial[seq.seq_id] += score_rows(rows, targets, top)

    def clear(self) -> None:
        self._partial.clear()
