"""Draft-model proposals: a smaller model with the same vocabulary guesses the next tokens.

`tallow serve --speculative draft --draft ARTIFACT` loads a second artifact with its own runner
and paged KV cache. Each step, for the sequences the policy lets propose, the draft's cache is
brought up to the sequence's tokens (rejected guesses of the last step popped, new tokens fed,
all sequences in one forward), then it decodes greedily, one batched forward per proposed
position. Its guesses are one token each, so verification (`step_postprocess.py`) keeps the
sampling distribution exactly, as with prompt lookup.

The draft's cache holds, per target sequence, the tokens it has seen; it is told when a
sequence ends (`forget`). A cache that runs out of pages drops every draft sequence and
proposes nothing that step: drafts are a speed-up, never a reason to fail a request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from .errors import TallowError
from .model_runner_protocol import ModelRunner
from .request import SequenceState

log = logging.getLogger(__name__)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int):
    """Refuse a draft whose token ids mean other text than the model's (one line)."""
    if draft_vocab != target_vocab:
        raise TallowError(
            f"--draft: its vocabulary has {draft_vocab} token ids, the model's {target_vocab}: "
            "a draft needs the model's tokenizer"
        )
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise TallowError("--draft: its tokenizer maps text to other ids than the model's")


class DraftProposer:
    """Greedy proposals from `runner` (the draft model), batched across sequences."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._held: dict[int, list[int]] = {}  # seq_id -> the tokens in the draft's cache

    def propose(self, seq: SequenceState, k: int) -> list[int]:
        return self.propose_batch([seq], [k]).get(seq.seq_id, [])

    def propose_batch(
        self, seqs: Sequence[SequenceState], ks: Sequence[int]
    ) -> dict[int, list[int]]:
        try:
            return self._propose(seqs, ks)
        except Exception as e:  # noqa: BLE001 - e.g. the draft's cache is full
            log.warning("draft model: %s; its cache is cleared", e)
            for seq_id in list(self._held):
                self.forget(seq_id)
            return {}

    def forget(self, seq_id: int) -> None:
        if self._held.pop(seq_id, None) is not None:
            self.runner.remove_sequence(seq_id)

    def _propose(self, seqs, ks) -> dict[int, list[int]]:
        room = self.runner.context_window
        todo = [
            (s, k) for s, k in zip(seqs, ks, strict=True) if k > 0 and len(s.token_ids) + k <= room
        ]
        if not todo:
            return {}
        feeds = [self._catch_up(s) for s, _ in todo]
        guesses = {s.seq_id: [] for s, _ in todo}
        logits = self._feed([(s.seq_id, f) for (s, _), f in zip(todo, feeds, strict=True)])
        live = todo
        for _ in range(max(k for _, k in todo)):
            tokens = np.argmax(np.asarray(logits), axis=1)
            for (s, _), t in zip(live, tokens, strict=True):
                guesses[s.seq_id].append(int(t))
            live = [(s, k) for s, k in live if len(guesses[s.seq_id]) < k]
            if not live:
                break
            items = [(s.seq_id, [guesses[s.seq_id][-1]]) for s, _ in live]
            logits = self.runner.forward(items)
            for s, _ in live:
                self._held[s.seq_id].append(guesses[s.seq_id][-1])
        return guesses

    def _catch_up(self, seq: SequenceState) -> list[int]:
        """Pop what the draft holds past its agreement with `seq`; the tokens to feed."""
        tokens = seq.token_ids
        held = self._held.get(seq.seq_id)
        if held is None:
            self.runner.add_sequence(seq.seq_id)
            held = self._held[seq.seq_id] = []
        same = 0
        limit = min(len(held), len(tokens) - 1)  # always feed the last token: its logits
        while same < limit and held[same] == tokens[same]:
            same += 1
        if len(held) > same:
            self.runner.popn(seq.seq_id, len(held) - same)
            del held[same:]
        feed = list(tokens[same:])
        held.extend(feed)
        return feed

    def _feed(self, items: list[tuple[int, list[int]]]):
        """Forward `items` (prompts may be long) in chunks within the runner's limits; the
        logits after each item's last token."""
        limit = self.runner.prefill_chunk_size
        rows: dict[int, np.ndarray] = {}
        pending = [(sid, toks) for sid, toks in items]
        while pending:
            batch, budget, rest = [], limit, []
            for sid, toks in pending:
                if budget <= 0 or len(batch) >= self.runner.max_batch_size:
                    rest.append((sid, toks))
                    continue
                take = toks[:budget]
                batch.append((sid, take))
                budget -= len(take)
                if len(take) < len(toks):
                    rest.append((sid, toks[len(take) :]))
            logits = np.asarray(self.runner.forward(batch))
            for row, (sid, _) in enumerate(batch):
                rows[sid] = logits[row]
            pending = rest
        return np.stack([rows[sid] for sid, _ in items])
