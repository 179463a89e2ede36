"""The 4-bit i-quants iq4_nl and iq4_xs in numpy: decoders and a scale-search quantizer.

Both store a weight as a 4-bit index into one fixed non-linear table of 16 int8 values
(`TABLE`, the format's, as the `gguf` package's `IQ4_NL.kvalues`; denser near zero, where
Gaussian-like weights are) times a scale:

* iq4_nl (GGML type 20, 32 weights, 18 bytes): ``d:f16, qs:u8[16]``, value ``d * T[q]``;
  byte ``i`` holds weight ``i`` (low nibble) and ``i + 16`` (high), as the legacy formats.
* iq4_xs (GGML type 23, 256 weights, 136 bytes): ``d:f16, scales_h:u16, scales_l:u8[4],
  qs:u8[128]``. Group ``g`` (32 weights) has a 6-bit ``ls``: low 4 bits in nibble ``g % 2``
  of ``scales_l[g // 2]``, high 2 bits in bits ``2g, 2g + 1`` of ``scales_h``; value
  ``d * (ls - 32) * T[q]``, its 16 code bytes at ``8 + 16 g`` packed as iq4_nl's.

Both decoders are bit-exact with ``gguf.quants.dequantize``: an f16 has 11 significant
bits, ``ls - 32`` at most 6 and ``T`` 7, so every product is exact in float32.

The quantizer (no importance matrix) searches each 32-weight group's scale: a grid of
candidate scales mapping the group's largest weight to the table's ends, each weight to its
nearest table value, then the least-squares scale for those indices; the candidate with the
smallest squared error wins, and the indices are chosen again against the stored (f16, and
for iq4_xs 6-bit) scale. The round-trip errors are in `tests/test_quantizers.py` and
`tests/test_iquants.py`. Speed: about 220 ns a weight (2 threads on the shared 2-core Zen 3,
1024 x 1024; q4k 80-115 ns), 38 candidate scales each costing a nearest-index pass.
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32

TABLE = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8
)
_T = TABLE.astype(_F32)
_MIDPOINTS = (_T[1:] + _T[:-1]) / _F32(2)  # sorted table: nearest = how many lie below
# Candidate values of the group's largest weight, in table units: the scale maps it to
# either end of the table (-127 or 113, the two signs of the scale) or a little inside or
# beyond, where the least-squares refit moves it. Relative RMS error of iq4_nl on N(0, 1)
# weights (256 x 1024): the two ends alone 7.60%, 5 per sign 7.40%, 19 per sign 7.337%, the
# same as 61 per sign and as 61 over a wider range (7.336%). iq4_xs: trying 3 to 6 super-block
# scales per block instead of one gained 0.02 points (7.413 -> 7.39%): not kept.
_TARGETS = np.concatenate([np.linspace(-150.0, -100.0, 19), np.linspace(88.0, 135.0, 19)])
_TARGETS = _TARGETS.astype(_F32)
XS_GROUPS = 8  # 32-weight groups per iq4_xs super-block
XS_MAX_SCALE = 32  # ls - 32 runs from -32 to 31


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(x.shape[0], 2)


def _f16_value(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").astype(_F32).reshape(b.shape[0], 1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 32] indices -> [..., 16] bytes: low nibble weight i, high nibble weight i + 16."""
    q = q.astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _nearest(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Index of the table value nearest x / scale (scale broadcast over the last axis; a zero
    scale gives index 8, the value nearest zero)."""
    inv = np.zeros_like(scale)
    np.divide(_F32(1), scale, out=inv, where=scale != 0)
    y = x * inv
    # the midpoints below y, counted with 15 branch-free compares: 3-10x faster than
    # np.searchsorted here, the same index (ties go to the lower one in both)
    q = np.zeros(y.shape, np.uint8)
    for m in _MIDPOINTS:
        q += y > m
    return q


def _best_group_scales(x: np.ndarray) -> np.ndarray:
    """[..., 32] weights -> [...] the float32 scale of each group that the search found."""
    amax = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    best_err = np.full(amax.shape, np.inf, _F32)
    best = np.zeros(amax.shape, _F32)
    sum_x2 = np.einsum("...i,...i->...", x, x)
    for target in _TARGETS:
        t = _T[_nearest(x, (amax / target)[..., None])]
        sum_xt = np.einsum("...i,...i->...", x, t)
        sum_t2 = np.einsum("...i,...i->...", t, t)  # >= 32: no table value is 0
        scale = sum_xt / sum_t2
        err = sum_x2 - sum_xt * scale  # squared error at the least-squares scale
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, scale, best)
    return np.where(amax == 0, _F32(0), best)


# ------------------------------------------------------------------------------------ iq4_nl


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    d = _best_group_scales(x.astype(_F32))[:, None]
    d_bytes = _f16_bytes(d)
    q = _nearest(x, _f16_value(d_bytes))
    return np.concatenate([d_bytes, _pack_nibbles(q)], axis=1)


def dequantize_iq4_nl(b: np.ndarray) -> np.ndarray:
    d = _f16_value(b[:, 0:2])
    return d * _T[_unpack_nibbles(b[:, 2:])]


# ------------------------------------------------------------------------------------ iq4_xs


def xs_group_scales(b: np.ndarray) -> np.ndarray:
    """[n, 136] blocks -> [n, 8] int32 ``ls - 32`` of each group."""
    high = np.ascontiguousarray(b[:, 2:4]).view("<u2").astype(np.int32)  # [n, 1]
    low = _unpack_nibbles_interleaved(b[:, 4:8]).astype(np.int32)
    top = (high >> (2 * np.arange(XS_GROUPS))) & 3
    return (low | (top << 4)) - XS_MAX_SCALE


def _unpack_nibbles_interleaved(b: np.ndarray) -> np.ndarray:
    """[n, 4] bytes -> [n, 8]: value 2i the low nibble of byte i, 2i + 1 its high nibble."""
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1)


def _pack_group_scales(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 8] ints in -32..31 -> (scales_h [n, 2], scales_l [n, 4]) bytes."""
    ls = (m + XS_MAX_SCALE).astype(np.uint32)
    high = ((ls >> 4) << (2 * np.arange(XS_GROUPS, dtype=np.uint32))).sum(axis=1, dtype=np.uint32)
    high_bytes = np.ascontiguousarray(high.astype("<u2")).view(np.uint8).reshape(-1, 2)
    low = (ls & 15).astype(np.uint8)
    return high_bytes, low[:, 0::2] | (low[:, 1::2] << 4)


def _group_error(x: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices, squared error) of groups `x` [..., 32] at fixed `scale` [...]."""
    q = _nearest(x, scale[..., None])
    err = x - scale[..., None] * _T[q]
    return q, np.einsum("...i,...i->...", err, err)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    groups = x.astype(_F32).reshape(n, XS_GROUPS, 32)
    scales = _best_group_scales(groups)
    # d: the group scale of largest magnitude is d * -32 (the integer range's longer end)
    big = np.take_along_axis(scales, np.abs(scales).argmax(axis=1)[:, None], axis=1)
    d_bytes = _f16_bytes(big / _F32(-XS_MAX_SCALE))
    d = _f16_value(d_bytes)
    inv = np.zeros_like(d)
    np.divide(_F32(1), d, out=inv, where=d != 0)
    # each group's integer scale: the nearest to its float scale, or a neighbour if that fits
    # the group's weights better once the indices are chosen again
    nearest = np.rint(scales * inv)
    best_m = np.zeros((n, XS_GROUPS), np.int32)
    best_q = np.zeros((n, XS_GROUPS, 32), np.uint8)
    best_err = np.full((n, XS_GROUPS), np.inf, _F32)
    for step in (0, -1, 1):
        m = np.clip(nearest + step, -XS_MAX_SCALE, XS_MAX_SCALE - 1).astype(np.int32)
        q, err = _group_error(groups, d * m.astype(_F32))
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_m = np.where(better, m, best_m)
        best_q = np.where(better[..., None], q, best_q)
    high, low = _pack_group_scales(best_m)
    codes = _pack_nibbles(best_q).reshape(n, XS_GROUPS * 16)
    return np.concatenate([d_bytes, high, low, codes], axis=1)


def dequantize_iq4_xs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16_value(b[:, 0:2])
    dl = d * xs_group_scales(b).astype(_F32)  # [n, 8], exact
    q = _unpack_nibbles(b[:, 8:].reshape(n, XS_GROUPS, 16))
    return (dl[:, :, None] * _T[q]).reshape(n, XS_GROUPS * 32)
