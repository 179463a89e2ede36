"""How well a compiled model predicts a text, alone or against a reference artifact.

Windows follow llama.cpp's `llama-perplexity`, so the figures compare with llama.cpp's on
the same text and tokenizer: the tokens are cut into consecutive, non-overlapping windows of
`context` tokens (a tail shorter than a window is dropped), each window runs from an empty KV cache,
and only its second half is scored: the logits after tokens `first .. context-2`
(`first = context // 2`) predict tokens `first+1 .. context-1`, so every scored token has at
least half a window before it. When the tokenizer adds BOS, the token stream starts with BOS
and each window's first token is replaced by BOS, as llama.cpp does.

Against a reference (typically the f32 artifact of the same model), per scored token:
KL(P_ref || P) = sum_v p_ref(v) * (log p_ref(v) - log p(v)) in float64, summarised as its mean,
median, 99th percentile (numpy's linear interpolation) and maximum, as `llama-perplexity
--kl-divergence` reports it; top-1 agreement is the share of scored tokens whose most likely
next token is the same in both ("Same top p" in llama.cpp). Both models run each window in
turn and only that window's logits are held, so memory does not grow with the text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import TallowError
from .model_runner import TVMModelRunner, all_position_logits
from .served_model import ServedModel

# Rows of logits turned into float64 log-probabilities at a time: 32 rows of a 262k vocabulary
# are 67 MB per array, where a whole 256-row half window would be 537 MB.
_ROWS_PER_BLOCK = 32


class EvalError(TallowError):
    """A text, window size or reference that cannot be evaluated as asked."""


@dataclass(frozen=True)
class EvalResult:
    context: int
    windows: int
    tokens_scored: int
    perplexity: float
    # With a reference artifact only:
    reference_perplexity: float | None = None
    kl_mean: float | None = None
    kl_median: float | None = None
    kl_p99: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None

    @property
    def delta_perplexity(self) -> float | None:
        if self.reference_perplexity is None:
            return None
        return self.perplexity - self.reference_perplexity

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "delta_perplexity": self.delta_perplexity}


def perplexity(runner: TVMModelRunner, tokens: list[int]) -> float:
    """Perplexity of every token after the first, in one pass (no windows)."""
    logits = all_position_logits(runner, tokens)[:-1]
    targets = np.asarray(tokens[1:])
    totals = _Totals()
    for start in range(0, len(targets), _ROWS_PER_BLOCK):
        rows = slice(start, start + _ROWS_PER_BLOCK)
        totals.add(logits[rows], targets[rows], None)
    return float(np.exp(totals.nll / totals.scored))


def text_tokens(runner: TVMModelRunner, text: str) -> list[int]:
    """The token stream of a text: special-token spellings stay text; BOS first when the
    tokenizer adds one."""
    ids = ServedModel.from_runner(runner).encode_text(text, add_special_tokens=False)
    bos = bos_of(runner)
    return ids if bos is None else [bos, *ids]


def check_same_vocabulary(runner, reference) -> None:
    """Refuse a reference whose token ids mean other tokens: KL divergence and top-1
    agreement compare two distributions over the same ids."""
    if runner.vocab_size != reference.vocab_size:
        raise EvalError(
            f"the reference {reference.folder} has a vocabulary of {reference.vocab_size} "
            f"tokens, {runner.folder} one of {runner.vocab_size}: compare artifacts compiled "
            "from the same model"
        )
    ours = runner.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    theirs = reference.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    if ours != theirs or bos_of(runner) != bos_of(reference):
        differing = sorted(set(ours.items()) ^ set(theirs.items()))
        example = f" (e.g. {differing[0][0]!r})" if differing else " (BOS differs)"
        raise EvalError(
            f"the reference {reference.folder} has another tokenizer than {runner.folder}: "
            f"{len({t for t, _ in differing})} tokens differ{example}; compare artifacts "
            "compiled from the same model"
        )


def check_context(context: int) -> None:
    if context < 4:
        raise EvalError(f"--context {context}: a window needs at least 4 tokens")


def windows(tokens: list[int], context: int, bos: int | None) -> list[list[int]]:
    """The windows llama-perplexity evaluates (see the module docstring)."""
    check_context(context)
    count = len(tokens) // context
    if count < 2:
        raise EvalError(
            f"the text has {len(tokens)} tokens; --context {context} needs at least "
            f"{2 * context} (two windows, each scored on its second half): give a longer "
            "text or a smaller --context"
        )
    out = [list(tokens[i * context : (i + 1) * context]) for i in range(count)]
    if bos is not None:
        for window in out:
            window[0] = bos
    return out


# (window tokens, first scored position) -> logits after positions first .. len(window)-2
WindowLogits = Callable[[list[int], int], np.ndarray]


def evaluate(
    runner: TVMModelRunner,
    tokens: list[int],
    context: int,
    reference: TVMModelRunner | None = None,
    on_window: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Perplexity of `runner` over `tokens` in windows of `context` tokens; with `reference`,
    also KL divergence, top-1 agreement and the reference's own perplexity on the same
    tokens. `on_window(done, total)` is called after each window."""
    for r in (runner, reference):
        if r is not None:
            _check_runner(r, context)
    if reference is not None:
        check_same_vocabulary(runner, reference)
    return evaluate_logits(
        _window_logits(runner),
        tokens,
        context,
        bos_of(runner),
        _window_logits(reference),
        on_window,
    )


def _window_logits(runner: TVMModelRunner | None) -> WindowLogits | None:
    if runner is None:
        return None
    return lambda window, first: all_position_logits(runner, window, start=first)[:-1]


def evaluate_logits(
    logits_of: WindowLogits,
    tokens: list[int],
    context: int,
    bos: int | None,
    reference_of: WindowLogits | None = None,
    on_window: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """`evaluate` over any source of window logits: so another engine's logits
    (`benchmarks/llama_cpp_parity.py`: llama.cpp's on the same GGUF) are scored by the very
    code, windows and statistics that score tallow's."""
    chunks = windows(tokens, context, bos)
    first = context // 2
    totals = _Totals()
    for done, window in enumerate(chunks, 1):
        targets = np.asarray(window[first + 1 :])
        logits = logits_of(window, first)
        ref = reference_of(window, first) if reference_of else None
        for start in range(0, len(targets), _ROWS_PER_BLOCK):
            rows = slice(start, start + _ROWS_PER_BLOCK)
            totals.add(logits[rows], targets[rows], None if ref is None else ref[rows])
        if on_window is not None:
            on_window(done, len(chunks))
    return totals.result(context, len(chunks))


class _Totals:
    """Sums over the scored tokens; the per-token KL values are kept for the percentiles
    (8 bytes a token)."""

    def __init__(self) -> None:
        self.scored = 0
        self.nll = 0.0
        self.ref_nll = 0.0
        self.agree = 0
        self.kl: list[np.ndarray] = []

    def add(self, logits: np.ndarray, targets: np.ndarray, ref: np.ndarray | None) -> None:
        logprobs = _log_softmax(logits)
        self.scored += len(targets)
        self.nll -= float(_pick(logprobs, targets).sum())
        if ref is None:
            return
        ref_logprobs = _log_softmax(ref)
        self.ref_nll -= float(_pick(ref_logprobs, targets).sum())
        self.kl.append((np.exp(ref_logprobs) * (ref_logprobs - logprobs)).sum(axis=-1))
        self.agree += int((logprobs.argmax(axis=-1) == ref_logprobs.argmax(axis=-1)).sum())

    def result(self, context: int, windows: int) -> EvalResult:
        ppl = float(np.exp(self.nll / self.scored))
        result = EvalResult(context, windows, self.scored, ppl)
        if not self.kl:
            return result
        kl = np.concatenate(self.kl)
        return dataclasses.replace(
            result,
            reference_perplexity=float(np.exp(self.ref_nll / self.scored)),
            kl_mean=float(kl.mean()),
            kl_median=float(np.median(kl)),
            kl_p99=float(np.percentile(kl, 99)),
            kl_max=float(kl.max()),
            top1_agreement=self.agree / self.scored,
        )


def _check_runner(runner: TVMModelRunner, context: int) -> None:
    if not runner.supports_generation:
        raise EvalError(f"{runner.folder} is an embedding-only artifact: it has no logits")
    if context > runner.context_window:
        raise EvalError(
            f"--context {context} is longer than {runner.folder}'s context window "
            f"({runner.context_window} tokens)"
        )


def bos_of(runner) -> int | None:
    """The token each window starts with, or None (see the module docstring)."""
    bundle = runner.tokenizer
    return bundle.bos_token_id if bundle.add_bos_token else None


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def _pick(logprobs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    return logprobs[np.arange(len(targets)), targets]
