"""`decode`'s one-row matmul for the lattice i-quants: the float fused kernel they took before
against the int8-activation kernel (`compiler/quant/grids/int8_groups.py`), with q4_0 and q4k
beside them for scale.

    TVM_NUM_THREADS=1 .venv/bin/python benchmarks/lattice_decode.py [--n 2048 --k 2048]
        [--qtypes iq3_s iq3_xxs ...] [--cold] [--rounds 5]

Random valid blocks (`tests/quant_blocks.py`: the lattice types have no quantizer), one
weight matrix per format; both kernels of a format get the same blocks and activations, and
the rounds interleave the kernels so that a noisy neighbour slows them alike. `--cold`
cycles through enough copies of the weights (64 MB) that each call reads them from memory.
Prints the best time per call (ms) of the float kernel, the AVX2 int8 one (`int8`; for iq3_s
`int8_grid_row`'s) and, on a CPU with AVX-512 VNNI, the one `decode` takes there (`vnni`:
`int8_grid_row`'s for iq3_s, the VNNI row kernels for q4_0 and q4k), and the int8 results'
largest difference from the float kernel's, relative to the largest output (the
activations' 8-bit rounding).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import tvm
from tvm.relax.frontend import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from quant_blocks import weight_blocks  # noqa: E402

from tallow.compiler.quant import QUANT_FORMATS  # noqa: E402
from tallow.compiler.target import resolve_target  # noqa: E402
from tallow.model_defs.quant_ops import QuantLinear  # noqa: E402
from tallow.schedules.cpu import int8_gemv, int8_vnni  # noqa: E402
from tallow.schedules.cpu import quant as cpu_quant  # noqa: E402

LATTICE = [q for q, f in QUANT_FORMATS.items() if f.table is not None]


class _Projection(nn.Module):
    def __init__(self, k: int, n: int, qtype: str):
        self.proj = QuantLinear(k, n, qtype)

    def decode(self, x):
        return self.proj(x)


def _build(func, target):
    with target:
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)


def kernels(qtype: str, n: int, k: int, target) -> dict:
    """{"float": ..., "int8": ...}: `decode`'s kernels for one format, compiled."""
    spec = {"decode": {"x": nn.spec.Tensor([1, 1, k], "float32")}}
    mod, _ = _Projection(k, n, qtype).export_tvm(spec)
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    out = {"float": _build(cpu_quant.schedule_func(func, target), target)["main"]}
    if QUANT_FORMATS[qtype].int8 is not None:
        out["int8"] = _build(int8_gemv.gemv_kernel(qtype, n, k, 1), target)["main"]
        if int8_vnni.supported(target):  # the VNNI one-row kernel, where the format has one
            out["vnni"] = _build(int8_gemv.gemv_kernel(qtype, n, k, 1, vnni=True), target)["main"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--qtypes", nargs="+", default=[*LATTICE, "q4_0", "q4k"])
    ap.add_argument("--cold", action="store_true", help="weights from memory on every call")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    target = resolve_target("cpu", "f32").tvm()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, args.k)).astype(np.float32)
    xt = tvm.runtime.tensor(x)
    cases = {}
    for qtype in args.qtypes:
        fmt = QUANT_FORMATS[qtype]
        blocks = weight_blocks(rng.standard_normal((args.n, args.k)).astype(np.float32), qtype)
        copies = max(1, int(64e6 // blocks.nbytes)) if args.cold else 1
        weights = [tvm.runtime.tensor(blocks) for _ in range(copies)]
        table = [tvm.runtime.tensor(np.ascontiguousarray(fmt.table()))] if fmt.table else []
        cases[qtype] = (kernels(qtype, args.n, args.k, target), weights, table)
    best: dict = {}
    results: dict = {}
    for _ in range(args.rounds):
        for qtype, (funcs, weights, table) in cases.items():
            for name, f in funcs.items():
                out = tvm.runtime.empty((1, 1, args.n), "float32")
                calls = max(8, 64 // len(weights)) * len(weights)
                t = time.perf_counter()
                for i in range(calls):
                    f(xt, weights[i % len(weights)], *table, out)
                per_call = (time.perf_counter() - t) / calls * 1e3
                best[qtype, name] = min(best.get((qtype, name), np.inf), per_call)
                results[qtype, name] = out.numpy().reshape(-1)
    mode = "cold: weights from memory" if args.cold else "weights in cache"
    print(f"[{args.n}, {args.k}] one row, best of {args.rounds} interleaved rounds, ms ({mode})")
    names = ["int8", "vnni"]
    head = "".join(f"{n:>8} {'x':>6}" for n in names)
    print(f"{'format':>8} {'float':>8} {head} {'error':>8}   (x: speed-up on float)")
    for qtype, (funcs, _, _) in cases.items():
        f_ms = best[qtype, "float"]
        ref = results[qtype, "float"]
        cells, err = "", 0.0
        for name in names:
            if name not in funcs:
                cells += f"{'-':>8} {'-':>6}"
                continue
            ms = best[qtype, name]
            cells += f"{ms:>8.3f} {f_ms / ms:>5.1f}x"
            err = max(err, np.abs(results[qtype, name] - ref).max() / np.abs(ref).max())
        print(f"{qtype:>8} {f_ms:>8.3f} {cells} {err:>8.1e}")


if __name__ == "__main__":
    main()
