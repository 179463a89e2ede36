"""Prefill matmul kernels side by side: int8 activations against the float tiles, per shape.

    TVM_NUM_THREADS=1 .venv/bin/python benchmarks/prefill_matmul.py \\
        [--shapes qwen2.5-0.5b llama3.2-3b] [--qtypes q4_1 q5_0 q4k q6k] [--tokens 500]

For each projection of each model shape (`decode_matmul.SHAPES`) and each format, times the
prefill kernel over `[1, tokens, K]` three ways, taking turns round by round (a noisy
neighbour slows them alike) and keeping each one's best: `float` (`cpu/quant.py`'s tiled
dequantize-matmul, what prefill ran on AVX2 CPUs before), `avx2` (`cpu/int8_prefill_columns`:
batched decode's AVX2 column tiles over the tokens) and, on CPUs with AVX-512 VNNI, `vnni`
(`cpu/int8_prefill`). `--clock cpu` (the default) measures the process's CPU time, which holds
on a loaded machine with TVM_NUM_THREADS=1; `wall` the elapsed time. Random weights,
quantized by `tallow.compiler.quant`; the error column is the int8 result's largest
difference from the float one relative to the largest output (the activations' rounding).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import tvm
from decode_matmul import SHAPES, _build, _Projection
from tvm.relax.frontend import nn

from tallow.compiler.quant import get_format, quantize
from tallow.compiler.target import resolve_target
from tallow.schedules.cpu import int8_prefill, int8_prefill_columns, int8_vnni
from tallow.schedules.cpu import quant as cpu_quant

# A 3B-class shape (Llama 3.2 3B: hidden 3072, 24 query and 8 KV heads of 128, MLP 8192):
# at this size the weights stream from memory in prefill too.
SHAPES.setdefault(
    "llama3.2-3b",
    [
        ("qkv", 3072, 5120),
        ("o", 3072, 3072),
        ("gate_up", 3072, 16384),
        ("down", 8192, 3072),
    ],
)


def kernels(qtype: str, n: int, k: int, target) -> dict:
    """{name: compiled kernel} of the prefill matmul for one format and shape."""
    spec = {"prefill": {"x": nn.spec.Tensor([1, "s", k], "float32")}}
    mod, _ = _Projection(k, n, qtype).export_tvm(spec)
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    out = {"float": _build(cpu_quant.schedule_func(func, target), target)}
    if int8_prefill_columns.supported(qtype) and n % int8_prefill_columns.COLS == 0:
        out["avx2"] = _build(int8_prefill_columns.prefill_kernel(qtype, n, k), target)
    if int8_vnni.supported(target) and n % int8_prefill.COLS == 0:
        out["vnni"] = _build(int8_prefill.prefill_kernel(qtype, n, k), target)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "llama3.2-3b"])
    ap.add_argument("--qtypes", nargs="+", default=["q4_1", "q5_0", "q4k", "q6k"])
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    target = resolve_target("cpu", "f32").tvm()
    rng = np.random.default_rng(0)
    print(f"{args.tokens} tokens, best of {args.rounds} interleaved rounds, ms ({args.clock})")
    print(f"{'shape':<32}{'format':<7}{'float':>9}{'avx2':>9}{'vnni':>9}{'speedup':>9}{'error':>9}")
    for model in args.shapes:
        for name, k, n in SHAPES[model]:
            if name == "head":  # prefill computes the head for the last row only
                continue
            for qtype in args.qtypes:
                if k % get_format(qtype).block_size:
                    continue
                blocks = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
                w = tvm.runtime.tensor(blocks)
                x = tvm.runtime.tensor(rng.standard_normal((1, args.tokens, k)).astype(np.float32))
                libs = kernels(qtype, n, k, target)
                outs = {kind: tvm.runtime.empty((1, args.tokens, n), "float32") for kind in libs}
                best = dict.fromkeys(libs, float("inf"))
                for kind, lib in libs.items():  # warm up
                    lib["main"](x, w, outs[kind])
                for _ in range(args.rounds):
                    for kind, lib in libs.items():
                        t = clock()
                        lib["main"](x, w, outs[kind])
                        best[kind] = min(best[kind], clock() - t)
                ref = outs["float"].numpy()
                fast = min((k_ for k_ in libs if k_ != "float"), key=best.get, default=None)
                err = np.abs(outs[fast].numpy() - ref).max() / np.abs(ref).max() if fast else 0.0

                speedup = best["float"] / best[fast] if fast else 1.0
                cells = "".join(
                    f"{best[kind] * 1e3:>9.1f}" if kind in best else f"{'-':>9}"
                    for kind in ("float", "avx2", "vnni")
                )
                label = f"{model} {name} {k}->{n}"
                print(f"{label:<32}{qtype:<7}{cells}{speedup:>8.2f}x{err:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
