"""Weight bytes per second of `decode`'s one-row int8 kernels (`schedules/cpu/int8_gemv.py`).

    TVM_NUM_THREADS=1 .venv/bin/python benchmarks/gemv_bandwidth.py --clock cpu
    TVM_NUM_THREADS=1 .venv/bin/python benchmarks/gemv_bandwidth.py --only q6k:128256x2048

Batch-1 decode streams every weight once per token, so its matrix-vector kernels should run
at the memory's speed: on the 2-core Zen 4 this was written on, one thread reads about
28 GB/s (a numpy sum of 512 MB), two about 56. Each case below is a real Q4_K_M projection
(format, rows N x row length K) of Llama 3.2 1B, Qwen2.5 0.5B or Gemma 3 270M, the output heads
included (the largest single kernels of a decode step). The weights are random blocks
quantized by `tallow.compiler.quant` (a 512-row slab repeated, so even the 200 MB heads are
quick to make), with enough copies that every call reads them from memory, not cache
(`COLD_BYTES`: past a Zen 4's L3; an Intel Xeon with 480 MiB of L3 holds them, so there the
figures are L3's, still a core's limit on lines in flight: docs/benchmarks.md).

`--clock cpu` times the process's CPU time: with `TVM_NUM_THREADS=1` on a shared machine it
is the steadier figure (the wall clock also counts the time others hold the core). Cases
take turns round by round, and the best round counts.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import tvm

from tallow.compiler.quant import get_format, quantize
from tallow.compiler.target import resolve_target
from tallow.schedules.cpu import int8_gemv, int8_vnni

# format:NxK (N weight rows = output features, K = row length)
CASES = [
    "q4k:16384x2048",  # llama 3.2 1B gate_up
    "q4k:2048x8192",  # llama down (q4k layers)
    "q6k:2048x8192",  # llama down (q6k layers)
    "q6k:128256x2048",  # llama tied head
    "q4k:2048x2048",  # llama o_proj
    "q5_0:9728x896",  # qwen2.5 gate_up
    "q8_0:151936x896",  # qwen2.5 head
    "q8_0:262144x640",  # gemma 3 head
    "q5_0:4096x640",  # gemma gate_up
]
SLAB = 512  # rows quantized once and repeated
COLD_BYTES = 96e6  # copies of a small weight until a pass over them leaves the caches


def _weights(qtype: str, n: int, k: int, hot: bool) -> list:
    rng = np.random.default_rng(0)
    slab = quantize(rng.standard_normal((min(SLAB, n), k)).astype(np.float32), qtype)
    blocks = np.ascontiguousarray(np.tile(slab, (-(-n // slab.shape[0]), 1))[:n])
    copies = 1 if hot else max(1, int(COLD_BYTES // blocks.nbytes) + 1)
    return [tvm.runtime.tensor(blocks) for _ in range(copies)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", nargs="+", help="cases as format:NxK (default: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--avx2", action="store_true", help="the AVX2 kernel on a VNNI CPU too")
    ap.add_argument("--hot", action="store_true", help="one copy: small weights stay cached")
    ap.add_argument("--asm", help="write the first case's assembly to this file")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    target = resolve_target("cpu", "f32").tvm()
    vnni = int8_vnni.supported(target) and not args.avx2
    cases = []
    for case in args.only or CASES:
        qtype, shape = case.split(":")
        n, k = (int(v) for v in shape.split("x"))
        func = int8_gemv.gemv_kernel(qtype, n, k, 1, vnni=vnni).with_attr("global_symbol", "main")
        with target:
            lib = tvm.compile(tvm.IRModule({"main": func}), target)
        if args.asm and not cases:
            with open(args.asm, "w") as f:
                f.write(lib.mod.inspect_source("asm"))
        rng = np.random.default_rng(1)
        x = tvm.runtime.tensor(rng.standard_normal((1, 1, k)).astype(np.float32))
        out = tvm.runtime.empty((1, 1, n), "float32")
        nbytes = n * get_format(qtype).row_bytes(k)
        cases.append((case, lib["main"], _weights(qtype, n, k, args.hot), x, out, nbytes))
    best = [float("inf")] * len(cases)
    for _ in range(args.rounds):
        for i, (_, f, weights, x, out, _) in enumerate(cases):
            f(x, weights[-1], out)
            t = clock()
            for w in weights:
                f(x, w, out)
            best[i] = min(best[i], (clock() - t) / len(weights))
    print(f"best of {args.rounds} rounds ({args.clock} clock), weights from memory")
    for (case, *_, nbytes), t in zip(cases, best, strict=True):
        print(f"{case:<20} {nbytes / 1e6:8.1f} MB {t * 1e6:9.1f} us {nbytes / t / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
