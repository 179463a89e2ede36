"""Decode matmul kernels side by side: the int8-activation kernels against the float tiled one.

    TVM_NUM_THREADS=2 .venv/bin/python benchmarks/decode_matmul.py --qtype q4_1 --n 3072 --k 576

For one weight shape and format (random weights, quantized with `tallow.compiler.quant`),
prints the best time of each kernel at several batch sizes: `int8` is what `batch_decode`
runs on x86 CPUs (`schedules/cpu/int8_gemv.py` for one row, `cpu/int8_batched.py` for
more: one compiled kernel with a symbolic batch, which from a few sequences on takes column
tiles: `cpu/int8_vnni.py`'s on CPUs with AVX-512 VNNI, else, for the formats that have
them, `cpu/int8_columns.py`'s), `avx2 columns` (on AVX-512 VNNI CPUs only) the same kernel
with the AVX2 column tiles, `int8 row tiles` with the column tiles off, `float tiled` the
prefill schedule of `cpu/tiled.py` on the same rows, and `int8 row` the static one-row
kernel of `decode`. `--cold` cycles through enough copies of the weights (64 MB) that every
call reads them from memory, as a model's decode step does; without it they stay in cache.
The error column is the int8 result's largest difference from the float one, relative to
the largest output (the activations' int8 rounding, about 1e-2 at most).

`--shapes qwen2.5-0.5b gemma3-270m ...` instead times `decode`'s one-row kernel (batch 1)
and `batch_decode`'s kernel at 16 sequences for each projection of those models (llama.cpp's
Q4_K_M mix puts several formats on one shape: every format in `--qtypes` runs at every
shape), weights from memory, best of interleaved rounds (the kernels take turns, so a noisy
neighbour slows them alike), and prints microseconds and the weight bytes read per second.
`--clock cpu` times the process's CPU time instead of the wall clock: with
`TVM_NUM_THREADS=1` on a loaded shared machine it is the steadier measure of a kernel's
cost (the wall clock also counts the time other processes hold the core).

`--tiles q4_1:3072:576 q6k:2048:1024 ...` (format:N:K) times the AVX2 column tiles against
the row tiles of `batch_decode`'s kernel at each `--batch`, weights from memory, best of
`--rounds` interleaved rounds, and prints the ratio: what decided that a format with column
tiles takes them at every batch size (`Int8Codes.column_tiles`).
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
from tallow.schedules.cpu import int8_gemv, int8_vnni
from tallow.schedules.cpu import quant as cpu_quant

# (name, K, N) of each projection; gate/up are fused (N = 2 x FFN); the head is Q8_0
SHAPES = {
    "qwen2.5-0.5b": [
        ("qkv", 896, 1152),
        ("o", 896, 896),
        ("gate_up", 896, 9728),
        ("down", 4864, 896),
        ("head", 896, 151936),
    ],
    "gemma3-270m": [
        ("q", 640, 1024),
        ("kv", 640, 512),
        ("o", 1024, 640),
        ("gate_up", 640, 4096),
        ("down", 2048, 640),
        ("head", 640, 262144),
    ],
    "llama3.2-1b": [
        ("qkv", 2048, 3072),
        ("o", 2048, 2048),
        ("gate_up", 2048, 16384),
        ("down", 8192, 2048),
        ("head", 2048, 128256),
    ],
}


class _Projection(nn.Module):
    def __init__(self, k: int, n: int, qtype: str):
        self.proj = QuantLinear(k, n, qtype)

    def prefill(self, x):
        return self.proj(x)


def _build(func, target):
    with target:
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)


def _best_ms(lib, x: np.ndarray, weights: list, out_shape: tuple, repeat: int) -> tuple:
    """Best time per call over 5 rounds of `repeat` passes over `weights` (tensors)."""
    out = tvm.runtime.empty(out_shape, "float32")
    rows = tvm.runtime.tensor(x.reshape(out_shape[:-1] + x.shape[-1:]))
    f = lib["main"]
    for _ in range(3):
        f(rows, weights[0], out)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeat):
            for w in weights:
                f(rows, w, out)
        best = min(best, (time.perf_counter() - t) / (repeat * len(weights)))
    return best * 1e3, out.numpy().reshape(x.shape[0], -1)


def _kernels_at(qtype: str, n: int, k: int, target, vnni: bool, batches) -> dict:
    """{batch: (compiled kernel, weight copies, repeat, x)} for one format and shape."""
    from tallow.compiler.quant import get_format

    rng = np.random.default_rng(0)
    blocks = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    copies = max(2, int(96e6 // blocks.nbytes))
    weights = [tvm.runtime.tensor(blocks) for _ in range(copies)]
    bytes_per_call = n * get_format(qtype).row_bytes(k)
    out = {}
    for b in batches:
        lib = _build(int8_gemv.gemv_kernel(qtype, n, k, 1 if b == 1 else None, vnni=vnni), target)
        x = tvm.runtime.tensor(rng.standard_normal((b, 1, k)).astype(np.float32))
        out[b] = (lib["main"], weights, x, tvm.runtime.empty((b, 1, n), "float32"))
    return out, bytes_per_call


def by_shape(models: list[str], qtypes: list[str], batches: list[int], rounds: int, clock) -> None:
    """Each format's decode kernels at each projection of `models` (see the module doc)."""
    target = resolve_target("cpu", "f32").tvm()
    vnni = int8_vnni.supported(target)
    cases = []  # (label, batch, f, weights, x, out, bytes)
    for model in models:
        for name, k, n in SHAPES[model]:
            for qtype in ["q8_0"] if name == "head" else qtypes:
                if k % 256 and get_format_block(qtype) == 256:
                    continue
                kernels, nbytes = _kernels_at(qtype, n, k, target, vnni, batches)
                for b, (f, weights, x, out) in kernels.items():
                    cases.append((f"{model} {name} {k}x{n} {qtype}", b, f, weights, x, out, nbytes))
    best = [float("inf")] * len(cases)
    for _ in range(rounds):
        for i, (_, _, f, weights, x, out, _) in enumerate(cases):
            t = clock()
            for w in weights:
                f(x, w, out)
            best[i] = min(best[i], (clock() - t) / len(weights))
    print(f"best of {rounds} interleaved rounds, weights from memory, us per call; GB/s of weights")
    for (label, b, *_, nbytes), t in zip(cases, best, strict=True):
        print(f"{label:<40} batch {b:>2} {t * 1e6:9.1f} us {nbytes / t / 1e9:6.1f} GB/s")


def by_tiles(cases: list[str], batches: list[int], rounds: int, clock) -> None:
    """The AVX2 column tiles against the row tiles, interleaved (see the module doc)."""
    target = resolve_target("cpu", "f32").tvm()
    rng = np.random.default_rng(0)
    runs = []  # (label, batch, rows kernel, columns kernel, weights, x, out)
    for case in cases:
        qtype, n, k = case.split(":")
        n, k = int(n), int(k)
        blocks = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
        weights = [tvm.runtime.tensor(blocks) for _ in range(max(2, int(64e6 // blocks.nbytes)))]
        rows = _build(int8_gemv.gemv_kernel(qtype, n, k, None, column_tiles=False), target)
        columns = _build(int8_gemv.gemv_kernel(qtype, n, k, None), target)
        for b in batches:
            x = tvm.runtime.tensor(rng.standard_normal((b, 1, k)).astype(np.float32))
            out = tvm.runtime.empty((b, 1, n), "float32")
            runs.append((f"{qtype} {n}x{k}", b, rows["main"], columns["main"], weights, x, out))
    best = {}
    for _ in range(rounds):
        for i, (_, _, rows, columns, weights, x, out) in enumerate(runs):
            for kind, f in (("rows", rows), ("columns", columns)):
                t = clock()
                for w in weights:
                    f(x, w, out)
                best[i, kind] = min(best.get((i, kind), float("inf")), (clock() - t) / len(weights))
    print(f"best of {rounds} interleaved rounds, weights from memory, us per call")
    for i, (label, b, *_) in enumerate(runs):
        r, c = best[i, "rows"] * 1e6, best[i, "columns"] * 1e6
        print(f"{label:<18} batch {b:>2}: row tiles {r:8.1f}  column tiles {c:8.1f}  {c / r:5.2f}x")


def get_format_block(qtype: str) -> int:
    from tallow.compiler.quant import get_format

    return get_format(qtype).block_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="time real shapes")
    ap.add_argument("--qtypes", nargs="+", default=["q4_1", "q5_0", "q4k", "q5k", "q6k"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--qtype", default="q4_1")
    ap.add_argument("--n", type=int, default=3072, help="output features (weight rows)")
    ap.add_argument("--k", type=int, default=576, help="input features")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--cold", action="store_true", help="weights read from memory each call")
    ap.add_argument("--tiles", nargs="+", help="FORMAT:N:K cases: column against row tiles")
    args = ap.parse_args()
    if args.tiles:
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        return by_tiles(args.tiles, args.batch, args.rounds, clock)
    if args.shapes:
        batches = [b for b in args.batch if b in (1, 16)] or [1, 16]
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        return by_shape(args.shapes, args.qtypes, batches, args.rounds, clock)
    target = resolve_target("cpu", "f32").tvm()
    if not int8_gemv.supported(target):
        raise SystemExit("this CPU has no AVX2: the int8 kernels do not apply")
    rng = np.random.default_rng(0)
    blocks = quantize(rng.standard_normal((args.n, args.k)).astype(np.float32), args.qtype)
    spec = {"prefill": {"x": nn.spec.Tensor([1, "s", args.k], "float32")}}
    mod, _ = _Projection(args.k, args.n, args.qtype).export_tvm(spec)
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    tiled = _build(cpu_quant.schedule_func(func, target), target)
    vnni = int8_vnni.supported(target)
    batched = _build(int8_gemv.gemv_kernel(args.qtype, args.n, args.k, None, vnni=vnni), target)
    avx2 = _build(int8_gemv.gemv_kernel(args.qtype, args.n, args.k, None), target)
    row_tiles = _build(
        int8_gemv.gemv_kernel(args.qtype, args.n, args.k, None, column_tiles=False), target
    )
    row = _build(int8_gemv.gemv_kernel(args.qtype, args.n, args.k, 1), target)
    copies = max(1, int(64e6 // blocks.nbytes)) if args.cold else 1
    weights = [tvm.runtime.tensor(blocks) for _ in range(copies)]
    repeat = max(1, args.repeat // copies)
    print(
        f"{args.qtype} weight [{args.n}, {args.k}], best of 5 x {repeat * copies} calls, ms"
        + (f" (cold: {copies} copies)" if args.cold else "")
    )
    print(
        f"{'batch':>5} {'float tiled':>12} {'int8 row tiles':>15} "
        + (f"{'avx2 columns':>13} " if vnni else "")
        + f"{'int8':>8} {'speedup':>8} {'int8 row':>9} {'error':>8}"
    )
    for b in args.batch:
        x = rng.standard_normal((b, 1, args.k)).astype(np.float32)
        t_float, ref = _best_ms(tiled, x, weights, (1, b, args.n), repeat)
        t_tiles, _ = _best_ms(row_tiles, x, weights, (b, 1, args.n), repeat)
        t_avx2 = f"{_best_ms(avx2, x, weights, (b, 1, args.n), repeat)[0]:13.3f} " if vnni else ""
        t_int8, got = _best_ms(batched, x, weights, (b, 1, args.n), repeat)
        t_row = f"{_best_ms(row, x, weights, (1, 1, args.n), repeat)[0]:9.3f}" if b == 1 else ""
        err = np.abs(got - ref).max() / np.abs(ref).max()
        print(
            f"{b:>5} {t_float:>12.3f} {t_tiles:>15.3f} {t_avx2}{t_int8:>8.3f} "
            f"{t_float / t_int8:>7.2f}x {t_row:>9} {err:>8.1e}"
        )


if __name__ == "__main__":
    main()
