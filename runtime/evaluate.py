"""Perplexity of a compiled model on a text: exp(mean negative log-likelihood per token)."""

from __future__ import annotations

import numpy as np

from .model_runner import TVMModelRunner, all_position_logits


def perplexity(runner: TVMModelRunner, tokens: list[int]) -> float:
    logits = all_position_logits(runner, tokens).astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    # the logits after token i predict token i + 1
    nll = -logprobs[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]
    return float(np.exp(nll.mean()))
