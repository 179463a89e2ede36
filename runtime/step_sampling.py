"""One step's sampling: rows the compiled sampler can take stay on the device, the rest go
through the host `Sampler`.

The compiled sampler (`sample_tokens` in the artifact, the runner's `sample`) covers
temperature, top-k, top-p and min-p. A row that asks for penalties, a logit bias or logprobs
needs the logits on the host, and so does a second sequence drawing from the same row (the
siblings of an n > 1 request at their first token). On a GPU the device path brings back
`n` token ids instead of `n x vocab` floats; the host copy happens only when a row needs it.

Each sampled row takes exactly one uniform from its own generator on either path, so a seeded
request gives the same tokens whatever shares its batch.

A row with a grammar (constrained decoding) comes with a bitmask of the tokens it may take
next; it goes to the host, where its disallowed logits become -inf before everything else
(penalties, bias, temperature, the cuts, the draw), so its logprobs are those of the masked
distribution. Unconstrained rows are untouched and keep the device path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .constraint import masks_to_bool
from .model_runner_protocol import ModelExecutor, SamplingControls
from .request import SequenceState
from .sampler import Sampler, SamplerOutput
from .sampling_params import SamplingParams


def device_can_sample(p: SamplingParams) -> bool:
    """Whether the compiled sampler covers everything `p` asks of a step."""
    # A prompt-scoring request's first token samples from its prompt's logits on the host.
    return not (
        p.has_penalties
        or p.logit_bias
        or p.logprobs
        or p.top_logprobs
        or p.grammar is not None
        or p.prompt_logprobs is not None
    )


class Histories:
    """Each sequence's prompt (or output) token ids, built only for the rows that read them
    (rows with penalties): most steps have none, and slicing every prompt cost per step."""

    def __init__(
        self,
        seqs: Sequence[SequenceState],
        prompt: bool,
        extra: Sequence[Sequence[int]] | None = None,
    ) -> None:
        # `extra`: tokens after the output, per entry (the proposals before a verified row)
        self.seqs, self.prompt, self.extra = seqs, prompt, extra

    def __getitem__(self, i: int) -> list[int]:
        seq = self.seqs[i]
        if self.prompt:
            return seq.token_ids[: seq.prompt_len]
        if self.extra is not None and self.extra[i]:
            return [*seq.output_token_ids, *self.extra[i]]
        return seq.output_token_ids

    def __len__(self) -> int:
        return len(self.seqs)


# The largest float32 below 1: a float64 draw can round up to 1.0 in float32.
_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))


class StepSampler:
    def __init__(self, runner: ModelExecutor, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler()
        self.on_device = runner.supports_device_sampling
        self._mask_buf: np.ndarray | None = None  # reused for masked copies of the logits
        self.device_rows = 0  # counters, for tests and benchmarks
        self.host_rows = 0

    def sample(
        self,
        logits,
        rows: Sequence[int],
        params: Sequence[SamplingParams],
        generators: Sequence[np.random.Generator | None],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        masks: Sequence[np.ndarray | None] | None = None,
    ) -> SamplerOutput:
        """One token per entry; entry i samples logits row `rows[i]` of the last forward.

        `logits` is what the forward returned (a host array, or a device handle that copies
        to the host when indexed); histories are read only by rows with penalties. `masks[i]`,
        when given and not None, is entry i's allowed-token bitmask (int32 words, llguidance's
        layout, see `constraint.masks_to_bool`); it must allow at least one token.
        """
        count = len(params)
        tokens = np.zeros(count, dtype=np.int64)
        logprobs: list[float | None] = [None] * count
        tops: list[list[tuple[int, float]] | None] = [None] * count
        device: dict[int, int] = {}  # logits row -> entry
        masked = [] if masks is None else [i for i in range(count) if masks[i] is not None]
        if self.on_device:
            for i, (row, p) in enumerate(zip(rows, params, strict=True)):
                unmasked = masks is None or masks[i] is None
                if row not in device and device_can_sample(p) and unmasked:
                    device[row] = i
        if device:
            tokens_dev = self._sample_on_device(len(logits), device, params, generators)
            for row, i in device.items():
                tokens[i] = tokens_dev[row]
        host = [i for i in range(count) if device.get(rows[i]) != i]
        if host:
            same_rows = [rows[i] for i in host] == list(range(len(logits)))
            # Every row, in order (plain decode): no fancy-index copy of the logits.
            x = logits if same_rows else np.asarray(logits)[[rows[i] for i in host]]
            if masked:
                x = self._apply_masks(x, host, masks)
            pen = [params[i].has_penalties for i in host]
            out = self.sampler.sample(
                x,
                [params[i] for i in host],
                [generators[i] for i in host],
                [prompt_ids[i] if q else () for i, q in zip(host, pen, strict=True)],
                [output_ids[i] if q else () for i, q in zip(host, pen, strict=True)],
            )
            for j, i in enumerate(host):
                tokens[i] = out.token_ids[j]
                logprobs[i] = out.logprobs[j]
                tops[i] = out.top_logprobs[j]
        self.device_rows += len(device)
        self.host_rows += len(host)
        return SamplerOutput(token_ids=tokens, logprobs=logprobs, top_logprobs=tops)

    def _apply_masks(self, x, host: list[int], masks) -> np.ndarray:
        """Host logits with each masked entry's disallowed tokens at -inf, in a buffer kept
        across steps (fresh pages for a batch x vocab copy cost more than the masking); the
        forward's logits are never edited."""
        js = [j for j, i in enumerate(host) if masks[i] is not None]
        packed = np.stack([masks[host[j]] for j in js])
        if not packed.any(axis=1).all():
            raise ValueError("a grammar mask allows no token")
        x = np.asarray(x)
        rows, width = x.shape
        if self._mask_buf is None or self._mask_buf.size < rows * width:
            self._mask_buf = np.empty(rows * width, dtype=np.float32)
        out = self._mask_buf[: rows * width].reshape(rows, width)
        np.copyto(out, x)
        banned = masks_to_bool(~packed, width)
        inf = np.float32(-np.inf)
        if len(js) == rows:
            np.copyto(out, inf, where=banned)
        else:
            for k, j in enumerate(js):
                np.copyto(out[j], inf, where=banned[k])
        return out

    def _sample_on_device(self, num_rows, device, params, generators) -> np.ndarray:
        # Rows nobody samples on the device (prefill chunks, host rows) run the cheap greedy
        # path; their tokens are ignored.
        temperature = np.zeros(num_rows, dtype=np.float32)
        top_k = np.zeros(num_rows, dtype=np.int32)
        top_p = np.ones(num_rows, dtype=np.float32)
        min_p = np.zeros(num_rows, dtype=np.float32)
        uniform = np.zeros(num_rows, dtype=np.float32)
        for row, i in device.items():
            p = params[i]
            if p.temperature == 0.0:
                continue
            gen = generators[i]
            if gen is None:
                raise ValueError(f"row {row} samples (temperature > 0) but has no generator")
            temperature[row] = p.temperature
            top_k[row] = max(p.top_k, 0)
            top_p[row] = p.top_p
            min_p[row] = p.min_p
            uniform[row] = min(gen.random(), _BELOW_ONE)
        controls = SamplingControls(temperature, top_k, top_p, min_p, uniform)
        return np.asarray(self.runner.sample(controls))
