"""The token sampler compiled into CPU artifacts: one kernel, rows on the thread pool.

Semantics are the host sampler's (`runtime/sampler.py`), so a row gives the same token
either way up to float32 rounding: temperature 0 picks the first maximum; otherwise
`y = logits / temperature`, then top-k, top-p and min-p cuts, each a threshold on `y` (ties
with the threshold token kept), then one draw by inverse CDF in token order with the
caller's uniform `u` (one per row, from the request's own generator, so a seeded request
does not depend on its batch companions).

No sort. Floats map to int32 keys that order the same way, and each cut is a bisection
over the keys (33 steps cover all 2**32), one vector pass over the row per step:

* top-k: the largest key K with count(key >= K) >= k, i.e. the k-th largest value;
* top-p: the largest K with mass(key >= K) >= top_p * mass left by top-k, i.e. the
  smallest head of the distribution that reaches top_p (the HF rule);
* min-p: y >= max(y) + log(min_p), no search.

The draw sums blocks of `BLOCK` tokens to find the one holding `u * total`, then walks that
block. Two scratch outputs hold `exp(y - max y)` and the keys, padded to whole blocks with
weight 0 and a key below every float's, so only the first pass has a tail.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from tallow.runtime.model_runner_protocol import CONTROL_COLUMNS

from ..tir_common import LOG2E, add, exp2, maximum, minimum, reduce_lanes

# Lanes of each pass's accumulators: four AVX2 registers, so four independent add (or max)
# chains hide the 3-cycle latency that one chain would wait on (2-3x on these passes).
LANES = 32
# Columns of the controls input, one row per logits row (`CONTROL_COLUMNS`: temperature,
# top_k as a float32, top_p, min_p, uniform draw). One input, so one copy per step.
CONTROLS = len(CONTROL_COLUMNS)
BLOCK = 256  # tokens per block of the two-level inverse CDF
STEPS = 33  # bisection steps: the key range [key(-inf), key(max) + 1) is below 2**32 wide
KEY_PAD = -(2**31)  # below key(-inf), so padding never passes a cut
FLOAT_MIN = -3.4028234663852886e38


def workspace_width(vocab: int) -> int:
    """Columns of the scratch outputs: the vocabulary rounded up to whole blocks."""
    return -(-vocab // BLOCK) * BLOCK


def key(v):
    """int32 key of float32 `v` with key(a) < key(b) exactly when a < b (no NaNs)."""
    b = tirx.reinterpret("int32", v)
    return b ^ ((b >> 31) & tirx.const(0x7FFFFFFF, "int32"))


KEY_NEG_INF = -2139095041  # key(-inf): the lowest key a real token can have


# The draw, shared by this kernel and the GPU one (`gpu.sampling`) so that both pick the same
# token: the tokens are cut into segments (blocks here, one per thread there), and with the
# scratch state `f`, `k` of both kernels (f[3] the target mass `u * total`, f[4] the mass
# before the chosen segment, f[5] a segment's mass, k[3] the cut's key):


@T.macro
def take_segment(f, k, s):
    """Segment `s`, of mass f[5], in token order: k[4] becomes the first segment whose mass
    carries the running sum past the target, k[5] the last one with any mass."""
    if f[5] > T.float32(0):
        k[5] = s
    if f[4] + f[5] > f[3]:
        k[4] = s
    else:
        f[4] += f[5]


@T.macro
def settle_segment(f, k):
    """After the segments: when `u * total` rounded up past their sums, the last segment with
    mass, walked to its end (its last kept token)."""
    if k[4] < 0:
        k[4] = k[5]
        f[3] = T.float32(math.inf)


def walk_macro(count: int, position, token_id):
    """A macro writing the drawn token of segment k[4]: the first kept token whose mass carries
    f[4] past f[3], else the segment's last kept token. Token `j` of segment `s` sits at
    `position(s, j)` of the scratch rows and is token `token_id(s, j)`."""

    @T.macro
    def walk(keys, weights, r, f, k, token):
        k[6] = T.int64(-1)
        k[7] = token_id(k[4], 0)
        for j in T.serial(count):
            if keys[r, position(k[4], j)] >= T.Cast("int32", k[3]):
                k[7] = token_id(k[4], j)
                if k[6] < 0:
                    f[4] += weights[r, position(k[4], j)]
                    if f[4] > f[3]:
                        k[6] = token_id(k[4], j)
        token[r] = T.Cast("int32", T.Select(k[6] >= 0, k[6], k[7]))

    return walk


def sample_kernel(vocab: int, padded: int):
    """PrimFunc(logits [n, padded], controls [n, CONTROLS]) -> token [n] int32, with scratch
    outputs weights [n, W] and keys [n, W] (W = `workspace_width(vocab)`)."""
    width = workspace_width(vocab)
    n_full = vocab // LANES  # whole vectors of logits; the rest go one at a time
    n_w = width // LANES
    n_b = width // BLOCK
    per_block = BLOCK // LANES
    f32_min = tirx.const(FLOAT_MIN, "float32")
    f32_neg_inf = tirx.const(-math.inf, "float32")
    walk = walk_macro(BLOCK, lambda b, j: b * BLOCK + j, lambda b, j: b * BLOCK + j)

    def logit(x, r, i):
        """x[r, i] for i < vocab, else the lowest float (a tail lane of the last vector)."""
        return T.Select(i < vocab, x[r, T.min(i, vocab - 1)], f32_min)

    @T.macro
    def mass_from(keys, weights, r, at_least, facc):
        """facc lanes <- per-lane sums of the weights whose key is >= at_least."""
        for ln in T.vectorized(LANES):
            facc[ln] = T.float32(0)
        for c in T.serial(n_w):
            for ln in T.vectorized(LANES):
                facc[ln] += T.Select(
                    keys[r, c * LANES + ln] >= T.Cast("int32", at_least),
                    weights[r, c * LANES + ln],
                    T.float32(0),
                )

    @T.prim_func(s_tir=True)
    def sample(
        logits_h: T.handle,
        controls_h: T.handle,
        token_h: T.handle,
        weights_h: T.handle,
        keys_h: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(logits_h, (n, padded), "float32")
        controls = T.match_buffer(controls_h, (n, CONTROLS), "float32")
        token = T.match_buffer(token_h, (n,), "int32")
        weights = T.match_buffer(weights_h, (n, width), "float32")
        keys = T.match_buffer(keys_h, (n, width), "int32")

        for r in T.parallel(n):
            with T.sblock("row"):
                T.reads()
                T.writes()
                facc = T.sblock_alloc_buffer((LANES,), "float32")
                iacc = T.sblock_alloc_buffer((LANES,), "int32")
                # f[0] max logit, f[1] max of y, f[2] mass goal, f[3] target, f[4] running
                # sum, f[5] block sum; k[0] lo, k[1] hi, k[2] mid, k[3] cut key, k[4] found
                # block, k[5] last block with mass, k[6] picked token, k[7] last kept token
                f = T.sblock_alloc_buffer((8,), "float32")
                k = T.sblock_alloc_buffer((8,), "int64")

                # one pass for the maximum and, per lane, the first index holding it
                for ln in T.vectorized(LANES):
                    facc[ln] = f32_neg_inf
                    iacc[ln] = ln
                for c in T.serial(n_full):
                    for ln in T.vectorized(LANES):
                        iacc[ln] = T.Select(
                            x[r, c * LANES + ln] > facc[ln], c * LANES + ln, iacc[ln]
                        )
                        facc[ln] = T.max(facc[ln], x[r, c * LANES + ln])
                f[0] = reduce_lanes(facc[T.Ramp(0, 1, LANES)], LANES, maximum)
                k[6] = T.Cast(
                    "int64",
                    reduce_lanes(
                        T.Select(
                            facc[T.Ramp(0, 1, LANES)] == T.Broadcast(f[0], LANES),
                            iacc[T.Ramp(0, 1, LANES)],
                            T.Broadcast(vocab, LANES),
                        ),
                        LANES,
                        minimum,
                    ),
                )
                for i in T.serial(n_full * LANES, vocab):  # later indices: only a larger value
                    if x[r, i] > f[0]:
                        f[0] = x[r, i]
                        k[6] = T.Cast("int64", i)

                if controls[r, 0] <= T.float32(0) or f[0] <= f32_min:
                    # greedy (or nothing finite): the first index holding the maximum
                    token[r] = T.Cast("int32", T.min(k[6], vocab - 1))
                else:
                    # division by a positive number keeps the order, so max(y) = max(x) / t
                    f[1] = f[0] / controls[r, 0]
                    for c in T.serial(n_full):
                        for ln in T.vectorized(LANES):
                            weights[r, c * LANES + ln] = exp2(
                                (x[r, c * LANES + ln] / controls[r, 0] - f[1]) * T.float32(LOG2E)
                            )
                            keys[r, c * LANES + ln] = key(x[r, c * LANES + ln] / controls[r, 0])
                    for i in T.serial(n_full * LANES, width):  # the tail, then the padding
                        weights[r, i] = T.Select(
                            i < vocab,
                            exp2((logit(x, r, i) / controls[r, 0] - f[1]) * T.float32(LOG2E)),
                            T.float32(0),
                        )
                        keys[r, i] = T.Select(
                            i < vocab, key(logit(x, r, i) / controls[r, 0]), KEY_PAD
                        )
                    k[3] = T.int64(KEY_NEG_INF)
                    if controls[r, 1] > T.float32(0) and controls[r, 1] < T.float32(vocab):
                        k[0] = T.int64(KEY_NEG_INF)
                        k[1] = T.Cast("int64", key(f[1])) + 1
                        for _step in T.serial(STEPS):
                            if k[1] - k[0] > 1:
                                k[2] = (k[0] + k[1]) >> 1
                                for ln in T.vectorized(LANES):
                                    iacc[ln] = 0
                                for c in T.serial(n_w):
                                    for ln in T.vectorized(LANES):
                                        iacc[ln] += T.Select(
                                            keys[r, c * LANES + ln] >= T.Cast("int32", k[2]), 1, 0
                                        )
                                count = reduce_lanes(iacc[T.Ramp(0, 1, LANES)], LANES, add)
                                if count >= T.Cast("int32", controls[r, 1]):
                                    k[0] = k[2]
                                else:
                                    k[1] = k[2]
                        k[3] = k[0]
                    if controls[r, 2] < T.float32(1):
                        mass_from(keys, weights, r, k[3], facc)
                        f[2] = reduce_lanes(facc[T.Ramp(0, 1, LANES)], LANES, add) * controls[r, 2]
                        k[0] = k[3]
                        k[1] = T.Cast("int64", key(f[1])) + 1
                        for _step in T.serial(STEPS):
                            if k[1] - k[0] > 1:
                                k[2] = (k[0] + k[1]) >> 1
                                mass_from(keys, weights, r, k[2], facc)
                                if reduce_lanes(facc[T.Ramp(0, 1, LANES)], LANES, add) >= f[2]:
                                    k[0] = k[2]
                                else:
                                    k[1] = k[2]
                        k[3] = k[0]
                    if controls[r, 3] > T.float32(0):
                        k[3] = T.max(k[3], T.Cast("int64", key(f[1] + T.log(controls[r, 3]))))

                    mass_from(keys, weights, r, k[3], facc)
                    f[3] = reduce_lanes(facc[T.Ramp(0, 1, LANES)], LANES, add) * controls[r, 4]
                    f[4] = T.float32(0)
                    k[4] = T.int64(-1)
                    k[5] = T.int64(0)
                    for b in T.serial(n_b):
                        if k[4] < 0:
                            for ln in T.vectorized(LANES):
                                facc[ln] = T.float32(0)
                            for c in T.serial(per_block):
                                for ln in T.vectorized(LANES):
                                    facc[ln] += T.Select(
                                        keys[r, b * BLOCK + c * LANES + ln]
                                        >= T.Cast("int32", k[3]),
                                        weights[r, b * BLOCK + c * LANES + ln],
                                        T.float32(0),
                                    )
                            f[5] = reduce_lanes(facc[T.Ramp(0, 1, LANES)], LANES, add)
                            take_segment(f, k, b)
                    settle_segment(f, k)
                    walk(keys, weights, r, f, k, token)

    return sample
