"""Single-request generation, as `tallow generate` runs it: prefill in chunks, then decode."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from .model_runner import TVMModelRunner
from .sampler import make_generator
from .sampling_params import SamplingParams
from .step_sampling import StepSampler

SEQ_ID = 0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first token comes from prefill; decode rate counts the tokens after it.
        n = self.generated_tokens - 1
        return n / self.decode_seconds if self.decode_seconds and n > 0 else 0.0


def generate_tokens(
    runner: TVMModelRunner,
    prompt_ids: list[int],
    params: SamplingParams,
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Yield generated token ids one at a time; fills `stats` as it goes."""
    stats = stats if stats is not None else GenerationStats()
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) + params.max_tokens > runner.context_window:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"context window of {runner.context_window} tokens"
        )
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(runner.tokenizer.eos_token_ids)
    rng = make_generator(params.seed)
    output: list[int] = []
    sampling = StepSampler(runner)  # the artifact's compiled sampler when it has one
    stats.prompt_tokens = len(prompt_ids)
    runner.add_sequence(SEQ_ID)
    try:
        t0 = time.perf_counter()
        chunk = runner.prefill_chunk_size
        for start in range(0, len(prompt_ids), chunk):
            logits = runner.forward([(SEQ_ID, prompt_ids[start : start + chunk])])
        stats.prefill_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(params.max_tokens):
            if output:
                logits = runner.forward([(SEQ_ID, [output[-1]])])
            out = sampling.sample(logits, [0], [params], [rng], [prompt_ids], [output])
            token = int(out.token_ids[0])
            output.append(token)
            stats.generated_tokens += 1
            if token in stop_ids:
                stats.finish_reason = "stop"
                break
            yield token
        else:
            stats.finish_reason = "length"
        stats.decode_seconds = time.perf_counter() - t0
    finally:
        runner.remove_sequence(SEQ_ID)


def generate_text_with_engine(
    engine, prompt_ids: list[int], params: SamplingParams, stats: GenerationStats
) -> Iterator[str]:
    """One request through an `Engine` (as `tallow generate --speculative` runs it): the
    text of each output as it comes; fills `stats` (prefill: up to the first output)."""
    outputs: list = []
    stats.prompt_tokens = len(prompt_ids)
    t0 = time.perf_counter()
    engine.submit(prompt_ids, params, outputs.append)
    first = None
    while engine._has_work():
        engine.run_step()
        for out in outputs:
            if isinstance(out, BaseException):
                raise out
            if first is None:
                first = time.perf_counter()
                stats.prefill_seconds = first - t0
            for delta in out.outputs:
                stats.generated_tokens += len(delta.token_ids)
                stats.generated_tokens += delta.finish_reason == "stop"  # its stop token
                stats.finish_reason = delta.finish_reason or stats.finish_reason
                if delta.text:
                    yield delta.text
        outputs.clear()
    if first is not None:
        stats.decode_seconds = time.perf_counter() - first
