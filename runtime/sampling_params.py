"""What a request asks of the sampler; shared by `tallow generate`, the engine and the server."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INT32_MAX = 2**31 - 1  # the engine keeps top_k and token counts in 32-bit arrays


class SamplingParamsError(ValueError):
    """A sampling parameter outside its valid range; the message names the field."""


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    # An llguidance grammar (`tallow.runtime.constraint`'s builders make one): every sampled
    # token must keep the output inside it. None: unconstrained.
    grammar: str | None = None
    # Prefill turn order among requests (`tallow.runtime.fairness`): lower goes first.
    priority: int = 0
    # Logprobs of the prompt's own tokens, computed from every prompt position's logits at
    # prefill (`prompt_logprobs.py`): None for none; k >= 0 for each prompt token's logprob
    # plus the k most likely tokens at its position (the first token has none). With it,
    # max_tokens may be 0: the prompt is scored and nothing is generated.
    prompt_logprobs: int | None = None
    # False: this request never speculates (`speculative.py`), whatever the server does.
    speculative: bool = True

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name}: {why} (got {getattr(self, name)!r})")

        if not 0 <= self.max_tokens <= INT32_MAX:
            raise bad("max_tokens", f"must be between 0 and {INT32_MAX}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not -1 <= self.top_k <= INT32_MAX:
            raise bad("top_k", f"must be -1, 0 or positive (at most {INT32_MAX})")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", "must be positive and finite")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be between -2 and 2")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be between -2 and 2")
        if not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", "must be between 0 and 20")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", "must be None or between 0 and 20")
        if not -INT32_MAX - 1 <= self.priority <= INT32_MAX:
            raise bad("priority", "must be a 32-bit integer")
        if self.n < 1:
            raise bad("n", "must be at least 1")
        if self.grammar is not None and (
            not isinstance(self.grammar, str) or not self.grammar.strip()
        ):
            raise bad("grammar", "must be a non-empty grammar string or None")
        if not all(math.isfinite(v) for v in self.logit_bias.values()):
            raise bad("logit_bias", "values must be finite")
        if vocab_size is not None:
            for tid in [*self.logit_bias, *self.stop_token_ids]:
                if not 0 <= int(tid) < vocab_size:
                    raise SamplingParamsError(
                        f"token id {tid} is outside the vocabulary (size {vocab_size})"
                    )

    @property
    def has_penalties(self) -> bool:
        """Repetition, frequency or presence penalties: the sampler needs the histories."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
