"""Decode matmul kernels side by side: the int8-activation kernels against the float tiled one.

    TVM_NUM_THREADS=2 .venv/bin/python benchmarks/decode_matmul.py --qtype q4_1 --n 3072 --k 576

For one weight shape and format (random weights, quantized with `tallow.compiler.quant`),
prints the best time of each kernel at several batch sizes: `int8` is what `batch_decode`
runs on AVX2 CPUs (`schedules/cpu_int8_gemv.py` for one row, `cpu_int8_batched.py` for
more: one compiled kernel with a symbolic batch), `float tiled` the prefill schedule of
`cpu_tiled.py` on the same rows, and `int8 row` the static one-row kernel of `decode`.
The error column is the int8 result's largest difference from the float one, relative to
the largest output (the activations' int8 rounding, about 1e-2 at most).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import tvm
from tvm.relax.frontend import nn

from tallow.compiler.quant import quantize
from tallow.compiler.target import resolve_target
from tallow.model_defs.quant_ops import QuantLinear
from tallow.schedules import cpu_int8_gemv, cpu_quant


class _Projection(nn.Module):
    def __init__(self, k: int, n: int, qtype: str):
        self.proj = QuantLinear(k, n, qtype)

    def prefill(self, x):
        return self.proj(x)


def _build(func, target):
    with target:
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)


def _best_ms(lib, x: np.ndarray, blocks: np.ndarray, out_shape: tuple, repeat: int) -> tuple:
    out = tvm.runtime.empty(out_shape, "float32")
    rows = x.reshape(out_shape[:-1] + x.shape[-1:])
    args = (tvm.runtime.tensor(rows), tvm.runtime.tensor(blocks))
    f = lib["main"]
    for _ in range(3):
        f(*args, out)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeat):
            f(*args, out)
        best = min(best, (time.perf_counter() - t) / repeat)
    return best * 1e3, out.numpy().reshape(x.shape[0], -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--qtype", default="q4_1")
    ap.add_argument("--n", type=int, default=3072, help="output features (weight rows)")
    ap.add_argument("--k", type=int, default=576, help="input features")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    target = resolve_target("cpu", "f32").tvm()
    if not cpu_int8_gemv.supported(target):
        raise SystemExit("this CPU has no AVX2: the int8 kernels do not apply")
    rng = np.random.default_rng(0)
    blocks = quantize(rng.standard_normal((args.n, args.k)).astype(np.float32), args.qtype)
    spec = {"prefill": {"x": nn.spec.Tensor([1, "s", args.k], "float32")}}
    mod, _ = _Projection(args.k, args.n, args.qtype).export_tvm(spec)
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    tiled = _build(cpu_quant.schedule_func(func, target), target)
    batched = _build(cpu_int8_gemv.gemv_kernel(args.qtype, args.n, args.k, None), target)
    row = _build(cpu_int8_gemv.gemv_kernel(args.qtype, args.n, args.k, 1), target)
    print(f"{args.qtype} weight [{args.n}, {args.k}], best of 5 x {args.repeat} calls, ms")
    print(
        f"{'batch':>5} {'float tiled':>12} {'int8':>8} {'speedup':>8} {'int8 row':>9} {'error':>8}"
    )
    for b in args.batch:
        x = rng.standard_normal((b, 1, args.k)).astype(np.float32)
        t_float, ref = _best_ms(tiled, x, blocks, (1, b, args.n), args.repeat)
        t_int8, got = _best_ms(batched, x, blocks, (b, 1, args.n), args.repeat)
        t_row = f"{_best_ms(row, x, blocks, (1, 1, args.n), args.repeat)[0]:9.3f}" if b == 1 else ""
        err = np.abs(got - ref).max() / np.abs(ref).max()
        print(
            f"{b:>5} {t_float:>12.3f} {t_int8:>8.3f} {t_float / t_int8:>7.2f}x {t_row:>9} "
            f"{err:>8.1e}"
        )


if __name__ == "__main__":
    main()
