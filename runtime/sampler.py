"""Host-side token sampling over float32 logits, vectorised over a batch with numpy.

Pipeline per row, in this order (the order HF `generate` and vLLM use):

1. penalties: repetition (prompt + output tokens, HF/vLLM rule: positive logits divided,
   negative multiplied), then OpenAI frequency/presence (output tokens only);
2. `logit_bias` added;
3. logprobs, when asked, are the log-softmax of the logits *at this point*: after penalties and
   bias, before temperature and truncation.  This is the distribution the request actually
   shaped, and it does not depend on how the sampler happens to cut the tail; it differs from
   vLLM's default (raw model log-softmax) only when penalties or bias are set;
4. temperature 0 -> argmax; otherwise divide by temperature, then top-k, top-p, min-p cuts
   (applied in that order, each on the distribution left by the previous one), then one draw.

Every cut is a threshold on the logit value, so all three combine into a single per-row
threshold and nothing is materialised per cut.  Ties with a threshold token are kept (as HF's
top-k does).

Reproducibility: each sequence owns a `numpy.random.Generator`; a row's draw uses exactly one
`random()` from its own generator, and all arithmetic for a row depends only on that row, so a
seeded request yields the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .sampling_params import SamplingParams

__all__ = [
    "Sampler",
    "SamplerOutput",
    "apply_logit_bias",
    "apply_penalties",
    "keep_thresholds",
    "log_softmax",
    "make_generator",
    "sample_controls",
    "warp_logits",
]

_TOP_P_FIRST_WINDOW = 64  # tokens sorted first for top-p; widened x4 until the mass is reached
_CDF_CHUNK_ELEMS = 1 << 22  # rows x vocab per chunk of the draw, to bound temporaries
_CDF_BLOCK = 1024  # tokens per block of the two-level inverse CDF


def make_generator(seed: int | None) -> np.random.Generator:
    """A per-sequence generator: seeded when the request gives a seed, fresh entropy otherwise."""
    if seed is None:
        return np.random.default_rng()
    # PCG64 wants a non-negative int; fold negatives so any Python int is a valid seed.
    return np.random.default_rng(int(seed) % (1 << 64))


@dataclass
class SamplerOutput:
    token_ids: np.ndarray  # int64 [batch]
    # log-probability of the chosen token (None when the row did not ask for logprobs)
    logprobs: list[float | None]
    # (token id, logprob) best first, `top_logprobs` long (None when the row asked for none)
    top_logprobs: list[list[tuple[int, float]] | None]


def _as_ids(ids, vocab_size: int) -> np.ndarray:
    arr = np.asarray(ids if ids is not None else (), dtype=np.int64).reshape(-1)
    # ids outside the logits (e.g. added tokens past a padded head) cannot be penalised
    return arr[(arr >= 0) & (arr < vocab_size)]


def apply_penalties(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]] | None,
    output_ids: Sequence[Sequence[int]] | None,
) -> None:
    """In place on a float [batch, vocab] array.  Rows without penalties cost nothing."""
    vocab = logits.shape[1]
    rep_rows, rep_toks, rep_vals = [], [], []
    add_rows, add_toks, add_vals = [], [], []
    for i, p in enumerate(params):
        out = None
        if p.repetition_penalty != 1.0:
            prompt = _as_ids(prompt_ids[i] if prompt_ids is not None else None, vocab)
            out = _as_ids(output_ids[i] if output_ids is not None else None, vocab)
            seen = np.unique(np.concatenate([prompt, out]))
            rep_rows.append(np.full(seen.size, i, dtype=np.int64))
            rep_toks.append(seen)
            pen = min(p.repetition_penalty, float(np.finfo(np.float32).max))  # float32 holds it
            rep_vals.append(np.full(seen.size, pen, dtype=np.float32))
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            if out is None:
                out = _as_ids(output_ids[i] if output_ids is not None else None, vocab)
            toks, counts = np.unique(out, return_counts=True)
            add_rows.append(np.full(toks.size, i, dtype=np.int64))
            add_toks.append(toks)
            # OpenAI: mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence
            add_vals.append((counts * p.frequency_penalty + p.presence_penalty).astype(np.float32))
    if rep_rows:
        r, t, pen = np.concatenate(rep_rows), np.concatenate(rep_toks), np.concatenate(rep_vals)
        v = logits[r, t]
        # Any positive penalty is valid, but 5e-324 is 0 in float32 and 1e-40 divides a logit
        # past float32's range: an infinite logit (or two) makes the softmax NaN. Clipped to
        # the finite range, such a penalty still does what it says (that token dominates).
        f32 = np.finfo(np.float32)
        pen = np.maximum(pen, f32.tiny)
        with np.errstate(over="ignore"):
            logits[r, t] = np.clip(np.where(v > 0, v / pen, v * pen), -f32.max, f32.max)
    if add_rows:
        # (row, token) pairs are unique per row, so fancy-index subtraction does not collide
        r, t = np.concatenate(add_rows), np.concatenate(add_toks)
        logits[r, t] -= np.concatenate(add_vals)


def apply_logit_bias(logits: np.ndarray, params: Sequence[SamplingParams]) -> None:
    """In place: add each row's `logit_bias` (token id -> bias)."""
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        if p.logit_bias:
            toks = np.fromiter((int(k) for k in p.logit_bias), dtype=np.int64)
            vals = np.fromiter((float(v) for v in p.logit_bias.values()), dtype=np.float32)
            ok = (toks >= 0) & (toks < vocab)
            logits[i, toks[ok]] += vals[ok]


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float32, with the normaliser summed in float64."""
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0).astype(np.float32)
    s = np.sum(np.exp(x - m), axis=-1, keepdims=True, dtype=np.float64)
    return (x - m - np.log(s).astype(np.float32)).astype(np.float32)


def keep_thresholds(
    y: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray
) -> np.ndarray:
    """Per row, the smallest logit that survives top-k, then top-p, then min-p (-inf: no cut).

    `y` holds temperature-scaled logits [rows, vocab]; the cut vectors are per row, with
    top_k <= 0 or >= vocab, top_p >= 1 and min_p <= 0 meaning "off".  No full sort of the
    vocabulary: top-k partitions out the k best, top-p sorts a growing window of the best.
    """
    rows, vocab = y.shape
    thr = np.full(rows, -np.inf, dtype=np.float32)
    if rows == 0:
        return thr
    rowmax = np.max(y, axis=1)

    k_on = (top_k > 0) & (top_k < vocab)
    if k_on.any():
        kmax = int(top_k[k_on].max())
        part = np.partition(y[k_on], vocab - kmax, axis=1)[:, vocab - kmax :]
        part = -np.sort(-part, axis=1)  # descending, only kmax wide
        thr[k_on] = part[np.arange(part.shape[0]), top_k[k_on] - 1]

    p_idx = np.flatnonzero(top_p < 1.0)
    if p_idx.size:
        # Normaliser of the distribution that top-k left behind.
        ys = y[p_idx]
        z = np.sum(
            np.where(ys >= thr[p_idx, None], np.exp(ys - rowmax[p_idx, None]), 0.0),
            axis=1,
            dtype=np.float64,
        )
        window = _TOP_P_FIRST_WINDOW
        pending = np.arange(p_idx.size)
        while pending.size:
            m = min(window, vocab)
            sub = ys[pending]
            best = np.partition(sub, vocab - m, axis=1)[:, vocab - m :] if m < vocab else sub
            best = -np.sort(-best, axis=1)
            rows_p = p_idx[pending]
            w = np.where(
                best >= thr[rows_p, None], np.exp(best - rowmax[rows_p, None]), 0.0
            ).astype(np.float64)
            cum = np.cumsum(w, axis=1) / z[pending, None]
            done = (cum[:, -1] >= top_p[rows_p]) | (m == vocab)
            if done.any():
                # HF rule: keep a token while the mass strictly before it is < top_p,
                # i.e. the smallest head whose mass reaches top_p.
                excl = np.concatenate([np.zeros((cum.shape[0], 1)), cum[:, :-1]], axis=1)
                n_keep = np.sum(excl < top_p[rows_p, None], axis=1)
                n_keep = np.maximum(n_keep, 1)[done]
                thr_p = best[done][np.arange(n_keep.size), n_keep - 1]
                thr[rows_p[done]] = np.maximum(thr[rows_p[done]], thr_p)
            pending = pending[~done]
            window *= 4

    m_on = min_p > 0.0
    if m_on.any():
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p); the max always survives
        # top-k/top-p, so renormalisation after them does not change the cut.
        thr_m = rowmax[m_on] + np.log(min_p[m_on]).astype(np.float32)
        thr[m_on] = np.maximum(thr[m_on], thr_m)
    return thr


def _cut_vectors(params: Sequence[SamplingParams]) -> tuple[np.ndarray, ...]:
    top_k = np.array([p.top_k for p in params], dtype=np.int64)
    top_p = np.array([p.top_p for p in params], dtype=np.float64)
    min_p = np.array([p.min_p for p in params], dtype=np.float32)
    return top_k, top_p, min_p


def warp_logits(logits: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """Temperature + top-k/top-p/min-p on processed logits; removed tokens become -inf.

    The sampler itself never builds this array (it draws straight from the thresholds); it is
    here for callers and tests that want the final distribution.  Rows must not be greedy.
    """
    temp = np.array([p.temperature for p in params], dtype=np.float32)
    y = (logits / temp[:, None]).astype(np.float32)
    thr = keep_thresholds(y, *_cut_vectors(params))
    return np.where(y >= thr[:, None], y, np.float32(-np.inf))


def _inverse_cdf(y: np.ndarray, thr: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Token per row with P(t) proportional to exp(y_t) over y_t >= thr; u is uniform [0, 1).

    Two-level inverse CDF: block sums locate the block holding u * total, and only that
    block gets a cumulative sum.  A full-vocabulary cumsum is sequential and was the slowest
    step of the draw; block sums vectorise.  Every reduction runs per row over a layout fixed
    by the vocabulary size, so a row's result does not depend on its batch companions.
    """
    rows, vocab = y.shape
    n_blocks = -(-vocab // _CDF_BLOCK)
    rowmax = np.max(y, axis=1, keepdims=True)
    rowmax = np.where(np.isfinite(rowmax), rowmax, 0.0).astype(np.float32)
    shifted = y - rowmax
    if np.isfinite(thr).any():
        shifted[y < thr[:, None]] = -np.inf  # cut tokens get weight exp(-inf) = 0
    np.exp(shifted, out=shifted)  # in place on a contiguous array: the costliest step
    if vocab % _CDF_BLOCK:
        w = np.zeros((rows, n_blocks * _CDF_BLOCK), dtype=np.float32)  # zero-padded tail
        w[:, :vocab] = shifted
    else:
        w = shifted
    blocks = w.reshape(rows, n_blocks, _CDF_BLOCK)
    block_cdf = np.cumsum(blocks.sum(axis=2, dtype=np.float64), axis=1)
    total = block_cdf[:, -1]
    target = u * total
    # First block whose CDF exceeds the target (searchsorted side="right"); a block with no
    # mass never raises the CDF, so it can never be that block.
    b = np.sum(block_cdf <= target[:, None], axis=1)
    over = b >= n_blocks  # u * total rounded up to total: use the last block with mass
    b[over] = np.argmax(block_cdf[over] >= total[over, None], axis=1)
    before = np.where(b > 0, block_cdf[np.arange(rows), np.maximum(b - 1, 0)], 0.0)
    inner = np.cumsum(blocks[np.arange(rows), b], axis=1, dtype=np.float64)
    j = np.sum(inner <= (target - before)[:, None], axis=1)
    # Summation order differs between the block sum and this cumsum, so the remainder can
    # overshoot by rounding: then take the block's last token with weight.
    over = j >= _CDF_BLOCK
    j[over] = np.argmax(inner[over] >= inner[over, -1:], axis=1)
    return b * _CDF_BLOCK + j


def _draw(x, temp, top_k, top_p, min_p, u) -> np.ndarray:
    """Token per row of `x`, every row sampled (temp > 0): temperature, the cuts, then the
    inverse-CDF draw at `u`; a row with nothing finite falls back to its argmax."""
    # A temperature near 0 (1e-300 is valid; in float32 it is 0) overflows to inf: such a row
    # is handled as "nothing finite" below and takes its argmax, the limit as temp -> 0.
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return _draw_scaled(x, x / temp[:, None], top_k, top_p, min_p, u)


def _draw_scaled(x, y, top_k, top_p, min_p, u) -> np.ndarray:
    thr = keep_thresholds(y, top_k, top_p, min_p)
    out = np.empty(len(x), dtype=np.int64)
    # Vectorised over rows; chunked so the float64 CDF stays ~32 MB.
    step = max(1, _CDF_CHUNK_ELEMS // max(y.shape[1], 1))
    for a in range(0, len(x), step):
        out[a : a + step] = _inverse_cdf(y[a : a + step], thr[a : a + step], u[a : a + step])
    banned = ~np.isfinite(np.max(y, axis=1))
    if banned.any():  # every token at -inf (biased away) or temp ~0: the unscaled argmax
        out[banned] = np.argmax(x[banned], axis=1)
    return out


def sample_controls(logits: np.ndarray, controls) -> np.ndarray:
    """Host version of the compiled sampler (`SamplingControls` per row): token per row.

    What the fake runner's `sample` runs, and the oracle for the compiled kernels.
    """
    x = np.asarray(logits, dtype=np.float32)
    temp = np.asarray(controls.temperature, dtype=np.float32)
    tokens = np.argmax(x, axis=1).astype(np.int64)
    s = np.flatnonzero(temp > 0)
    if s.size:

        def column(name: str, dtype) -> np.ndarray:
            return np.asarray(getattr(controls, name), dtype=dtype)[s]

        tokens[s] = _draw(
            x[s],
            temp[s],
            column("top_k", np.int64),
            column("top_p", np.float64),
            column("min_p", np.float32),
            column("uniform", np.float64),
        )
    return tokens


class Sampler:
    """Chooses one token per row.  Stateless: sequences own their generators and histories."""

    def sample(
        self,
        logits: np.ndarray,
        params: Sequence[SamplingParams],
        generators: Sequence[np.random.Generator | None],
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplerOutput:
        """`logits` [batch, vocab]; `params`, `generators`, histories: one entry per row.

        A greedy row may pass None as its generator; a sampled row must not.  Histories are
        needed only by rows with penalties.
        """
        # Copy only when penalties or biases edit the logits in place: at batch 16 over a 50k
        # vocabulary the copy (and its fresh pages) is most of a greedy step's host time.
        edits = any(p.has_penalties or p.logit_bias for p in params)
        x = np.array(logits, dtype=np.float32) if edits else np.asarray(logits, np.float32)
        if x.ndim != 2 or x.shape[0] != len(params) or len(generators) != len(params):
            raise ValueError("logits must be [batch, vocab] with one params/generator per row")
        batch, vocab = x.shape
        apply_penalties(x, params, prompt_ids, output_ids)
        apply_logit_bias(x, params)

        greedy = np.array([p.temperature == 0.0 for p in params], dtype=bool)
        if greedy.all():
            tokens = np.argmax(x, axis=1).astype(np.int64)
        else:
            tokens = np.zeros(batch, dtype=np.int64)
            if greedy.any():
                tokens[greedy] = np.argmax(x[greedy], axis=1)

        s_idx = np.flatnonzero(~greedy)
        if s_idx.size:
            sampled = [params[i] for i in s_idx]
            temp = np.array([p.temperature for p in sampled], dtype=np.float32)
            u = self._uniforms(s_idx, generators)
            tokens[s_idx] = _draw(x[s_idx], temp, *_cut_vectors(sampled), u)

        return self._logprobs(x, params, tokens)

    @staticmethod
    def _uniforms(rows, generators) -> np.ndarray:
        """Exactly one uniform per sampled row per step, from that row's own generator."""
        u = np.empty(len(rows), dtype=np.float64)
        for j, row in enumerate(rows):
            gen = generators[row]
            if gen is None:
                raise ValueError(f"row {row} samples (temperature > 0) but has no generator")
            u[j] = gen.random()
        return u

    @staticmethod
    def _logprobs(x, params, tokens) -> SamplerOutput:
        batch = len(params)
        chosen: list[float | None] = [None] * batch
        tops: list[list[tuple[int, float]] | None] = [None] * batch
        want = np.array([p.logprobs or p.top_logprobs > 0 for p in params], dtype=bool)
        if want.any():
            idx = np.flatnonzero(want)
            lp = log_softmax(x[idx])
            picked = lp[np.arange(idx.size), tokens[idx]]
            for j, i in enumerate(idx):
                chosen[i] = float(picked[j])
                n = min(params[i].top_logprobs, lp.shape[1])
                if n > 0:
                    best = np.argpartition(-lp[j], n - 1)[:n]
                    best = best[np.argsort(-lp[j, best], kind="stable")]
                    # Tokens a grammar mask removed (-inf) are not alternatives.
                    tops[i] = [(int(t), float(lp[j, t])) for t in best if lp[j, t] > -np.inf]
        return SamplerOutput(token_ids=tokens, logprobs=chosen, top_logprobs=tops)

    __call__ = sample
