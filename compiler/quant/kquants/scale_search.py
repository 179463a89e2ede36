"""Per-sub-block scale searches of the K-quant quantizers (`numpy_codec`).

Scale search follows the ideas of ggml's reference quantizers: an iterative weighted
least-squares fit of (scale, min) over a range of trial scales for the affine types
(``make_qkx2_quants``) and a least-squares search over trial scales for the symmetric types
(``make_qx_quants``).  All of it runs on every sub-block at once; the only Python loops are over
trial scales.  Trial fits are scored with a closed-form weighted squared error computed from
per-sub-block sums, so no extra pass over the weights is needed for the score.
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32
EPS = 1e-15  # ggml's GROUP_MAX_EPS


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise dot products of two [n, k] arrays, as float64 [n]."""
    return np.einsum("ij,ij->i", a, b).astype(np.float64)


def _rowsum(a: np.ndarray) -> np.ndarray:
    """Row sums of an [n, k] float32 array, as float64 [n] (a BLAS matrix-vector product)."""
    return (a @ np.ones(a.shape[1], dtype=a.dtype)).astype(np.float64)


def safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    out = np.zeros(np.broadcast_shapes(num.shape, den.shape), dtype=_F32)
    np.divide(num, den, out=out, where=den != 0)
    return out


# ------------------------------------------------------------------------------- scale searches


def search_affine(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray]:
    """Fit ``x ~ scale * q - mn`` with integer q in [0, nmax] for every row of x.

    Returns float32 ``scale`` and ``mn`` (both [n], ``mn >= 0``).  Trial quantizations use
    inverse scales ``(nmax + rmin + rdelta * i) / (max - min)`` for i in 0..nstep; each trial's
    codes get a weighted least-squares (scale, min) refit and the fit with the smallest weighted
    squared error wins.
    """
    lo = np.minimum(x.min(axis=1), _F32(0))
    hi = x.max(axis=1)
    rng = hi - lo
    flat = rng <= 0
    inv_rng = safe_div(np.ones_like(rng), rng)
    xm = x - lo[:, None]

    sw = _rowsum(w)
    wx = w * x
    swx = _rowsum(wx)
    swxx = _dot(wx, x)

    def codes(factor: float | np.ndarray) -> np.ndarray:
        iscale = (np.asarray(factor, dtype=_F32) * inv_rng)[:, None]
        q = xm * iscale
        np.rint(q, out=q)
        np.clip(q, 0, nmax, out=q)
        return q

    def sse(
        s: np.ndarray, m: np.ndarray, sl: np.ndarray, sl2: np.ndarray, slx: np.ndarray
    ) -> np.ndarray:
        # sum w * (s * l + m - x)^2 expanded into per-row sums (m is the signed offset here)
        return s * s * sl2 + 2 * s * m * sl + m * m * sw - 2 * s * slx - 2 * m * swx + swxx

    # plain min/max quantization as the starting point
    q = codes(nmax)
    wq = w * q
    sl, sl2, slx = _rowsum(wq), _dot(wq, q), _dot(wq, x)
    best_s = rng.astype(np.float64) / nmax
    best_m = lo.astype(np.float64)
    best_err = sse(best_s, best_m, sl, sl2, slx)

    for i in range(nstep + 1):
        q = codes(nmax + rmin + rdelta * i)
        wq = w * q
        sl, sl2, slx = _rowsum(wq), _dot(wq, q), _dot(wq, x)
        det = sw * sl2 - sl * sl
        ok = det > 0
        det = np.where(ok, det, 1.0)
        s = (sw * slx - swx * sl) / det
        m = (sl2 * swx - sl * slx) / det
        pos = m > 0  # the offset may not be positive: fall back to a scale-only fit
        s = np.where(pos, slx / np.where(sl2 > 0, sl2, 1.0), s)
        m = np.where(pos, 0.0, m)
        err = sse(s, m, sl, sl2, slx)
        better = ok & (err < best_err)
        best_s = np.where(better, s, best_s)
        best_m = np.where(better, m, best_m)
        best_err = np.where(better, err, best_err)

    best_s = np.where(flat, 0.0, best_s)
    best_m = np.where(flat, lo, best_m)
    return best_s.astype(_F32), (-best_m).astype(_F32)


def search_symmetric(
    x: np.ndarray, w: np.ndarray | None, nmax: int, trials: np.ndarray
) -> np.ndarray:
    """Fit ``x ~ scale * q`` with integer q in [-nmax, nmax - 1] for every row of x.

    The value of largest magnitude maps to ``-nmax`` for the untouched trial; ``trials`` are
    offsets added to nmax for the other trial inverse scales.  For each trial's codes the
    weighted least-squares scale is ``sum(w x q) / sum(w q^2)``; the trial maximising
    ``sum(w x q)^2 / sum(w q^2)`` (i.e. minimising the weighted squared error) wins;
    ``w=None`` means unit weights.  Returns the float32 scale per row (0 for all-zero rows).
    """
    idx = np.abs(x).argmax(axis=1)[:, None]
    amax = np.take_along_axis(x, idx, axis=1)[:, 0]
    inv_max = safe_div(np.ones_like(amax), amax)
    wx = x if w is None else w * x
    best_score = np.full(x.shape[0], -1.0)
    best_s = np.zeros(x.shape[0])
    for t in np.concatenate([[0.0], trials]):
        iscale = (_F32(-(nmax + t)) * inv_max)[:, None]
        q = x * iscale
        np.rint(q, out=q)
        np.clip(q, -nmax, nmax - 1, out=q)
        slx = _dot(wx, q)
        sl2 = _dot(q if w is None else w * q, q)
        good = sl2 > 0
        sl2 = np.where(good, sl2, 1.0)
        score = np.where(good, slx * slx / sl2, -1.0)
        better = score > best_score
        best_s = np.where(better, slx / sl2, best_s)
        best_score = np.where(better, score, best_score)
    return np.where(np.abs(amax) < EPS, 0.0, best_s).astype(_F32)
