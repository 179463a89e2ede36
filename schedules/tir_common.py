"""TIR helpers shared by the schedules of every target: the one public home for them.

* Static extents and vector widths, which every CPU schedule rule asks about a loop or target.
* Vectorisable float32 math for CPU kernels, where libm would be a scalar call per element.
  LLVM lowers `exp`, `exp2` and `sigmoid` on x86 to calls of libm's `expf` / `exp2f`, one per
  element: SiLU spent 4.6 ms of a 16-sequence decode step of SmolLM2 in them. These are plain
  arithmetic on the exponent bits and a polynomial, which LLVM vectorises.
* Small helpers for hand-written TIR over explicit vectors (lanes as one value). TVM 0.27's
  expressions do not expose a dtype from Python, so the lane counts are passed in.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx


# --- extents and vector widths -----------------------------------------------------------
def static_extent(extent) -> int | None:
    """The value of a loop extent or shape dimension, or None when it is symbolic."""
    return int(extent) if isinstance(extent, tirx.IntImm | int) else None


def register_lanes(target, dtype: str) -> int:
    """`dtype` lanes in one vector register of `target` (256 bits without a target), at most 16."""
    bits = register_bits(target) if target else 256
    lanes = max(1, int(bits) // tvm.DataType(dtype).bits)
    return min(lanes, 16)


def register_bits(target) -> int:
    """The vector register width of `target`'s instruction set. TVM's `llvm_get_vector_width`
    answers 512 for `mcpu: x86-64-v3` too (an AVX2 level, seen with TVM 0.27), so the target's
    own features bound it: the kernels of a portable library are shaped for its level."""
    bits = int(tvm.target.codegen.llvm_get_vector_width(target))
    for feature, width in (("avx512f", 512), ("avx", 256)):
        try:
            if tvm.target.codegen.target_has_features(feature, target):
                return min(bits, width)
        except Exception:  # noqa: BLE001 - an LLVM target without x86 features
            break
    return min(bits, 128)  # SSE, NEON


def llvm_has_features(target, features) -> bool:
    """Whether `target` is an LLVM target with every one of `features` (LLVM's names)."""
    if target is None or target.kind.name != "llvm":
        return False
    try:
        return all(bool(tvm.target.codegen.target_has_features(f, target)) for f in features)
    except Exception:  # noqa: BLE001 - an LLVM without this architecture has no such features
        return False


# --- float32 math without libm -----------------------------------------------------------
LOG2E = math.log2(math.e)
# 2**f on [0, 1): least-squares degree-6 fit, relative error 2.6e-9 (below float32's)
EXP2_POLY = (
    1.0000000025868898,
    0.6931469286930053,
    0.24023050204528248,
    0.055480426324589965,
    0.009684580454537375,
    0.0012387821460259052,
    0.00021877504828892534,
)


def _f32(v: float):
    return tirx.const(v, "float32")


def exp2(x, lanes: int = 1):
    """2**x for float32 `x` (a vector of `lanes` lanes when above 1), clamped to
    [2**-126, 2**127]: 2**floor(x) from the exponent bits times the polynomial of the fraction."""
    x = tirx.min(tirx.max(x, _f32(-126.0)), _f32(127.0))
    whole = tirx.floor(x)
    frac = x - whole
    poly = _f32(EXP2_POLY[-1])
    for c in reversed(EXP2_POLY[:-1]):
        poly = poly * frac + _f32(c)
    ints = "int32" if lanes == 1 else f"int32x{lanes}"
    scale = tirx.reinterpret(
        "float32" if lanes == 1 else f"float32x{lanes}", (tirx.Cast(ints, whole) + 127) << 23
    )
    return poly * scale


def sigmoid(x):
    """1 / (1 + e**-x). Relative error: below 6e-7 for |x| <= 10, 2e-6 to 40, 4e-6 to 87
    (the rounding of `x * log2(e)` grows with |x|); beyond, 1 and about 6e-39."""
    return _f32(1.0) / (_f32(1.0) + exp2(x * _f32(-LOG2E)))


# --- explicit vectors -------------------------------------------------------------------
def lanes(vec, idx):
    """The lanes `idx` of `vec`, in that order (a shuffle)."""
    return tirx.Shuffle([vec], [tirx.const(i, "int32") for i in idx])


def reduce_lanes(vec, count: int, combine):
    """Combine the `count` lanes of `vec` pairwise down to one scalar (log2(count) steps)."""
    while count > 1:
        count //= 2
        vec = combine(lanes(vec, range(count)), lanes(vec, range(count, 2 * count)))
    return vec


def add(a, b):
    return a + b


def maximum(a, b):
    return tirx.max(a, b)


def minimum(a, b):
    return tirx.min(a, b)


def _pair_sums(a, b):
    """Adjacent lanes of `a` and `b` (8 lanes each) added, within each half of 4 lanes:
    [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] (x86: one `vhaddps`)."""
    even = tirx.Shuffle([a, b], [tirx.const(i, "int32") for i in (0, 2, 8, 10, 4, 6, 12, 14)])
    odd = tirx.Shuffle([a, b], [tirx.const(i, "int32") for i in (1, 3, 9, 11, 5, 7, 13, 15)])
    return even + odd


def row_sums(buf, base):
    """One vector of 8 lanes: lane i is the sum of the 8 float32 lanes at
    buf[base + 8 * i : base + 8 * (i + 1)], for i in 0..7 (a transpose and add of 8 vectors)."""
    rows = [buf.vload([base + 8 * i], "float32x8") for i in range(8)]
    # [r0 (0-3), r1 (0-3), r2 (0-3), r3 (0-3), r0 (4-7), r1 (4-7), ...] and the same for r4-r7
    low = _pair_sums(_pair_sums(rows[0], rows[1]), _pair_sums(rows[2], rows[3]))
    high = _pair_sums(_pair_sums(rows[4], rows[5]), _pair_sums(rows[6], rows[7]))
    halves = [tirx.const(i, "int32") for i in (0, 1, 2, 3, 8, 9, 10, 11)]
    other = [tirx.const(i, "int32") for i in (4, 5, 6, 7, 12, 13, 14, 15)]
    return tirx.Shuffle([low, high], halves) + tirx.Shuffle([low, high], other)


def prefetch(address, locality: int = 3):
    """Ask the CPU to bring the cache line at `address` (a `tirx.address_of`) closer, for
    memory the hardware prefetchers would not predict or not early enough. Never faults.

    `locality` 3 (x86 `prefetcht0`) brings it into every level, L1 included; 1
    (`prefetcht2`) stops at the outer levels, so the request does not hold one of the few L1
    fill buffers until the line arrives: streaming weights, see `STREAM`."""
    return tirx.call_llvm_intrin(
        "void",
        "llvm.prefetch.p0",
        address,
        tirx.const(0, "int32"),  # a read
        tirx.const(locality, "int32"),
        tirx.const(1, "int32"),  # data, not instructions
    )


# `prefetch` locality for weights streamed once per call (decode's matrix-vector kernels).
STREAM = 1
