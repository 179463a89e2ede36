"""Decode matmuls over q4k blocks on a GPU, schedule against schedule, next to cuBLAS f16.

    .venv/bin/python benchmarks/gpu_gemv.py build benchmarks/gpu_bundle/gemv   # here (nvcc)
    python3 benchmarks/gpu_gemv.py run benchmarks/gpu_bundle/gemv              # on the GPU

The first GPU check (H100, 2026-12-06) ran a Qwen3-8B-shaped q4k decode at 14% of the
bandwidth bound at batch 1 and slower per token at batch 16 than at batch 1: this isolates
the matmuls. Two Qwen3-8B projections (gate_up: 24576 x 4096, down: 4096 x 12288), each at
1, 4, 16 and 64 rows, built here for sm_90 with each schedule:

- `gemv`: `QuantDecodeGEMV(unroll=1)`: one K block per loop iteration, the activations
  loaded 2 bytes at a time (the compiler's schedule before this benchmark, but for the order
  of its rows' loop: there the rows were innermost);
- `gemv_vx`: the rows outside the weights, each lane's activations of a row as 4-lane
  vector loads (`vector_x`), one block per iteration;
- `gemv_auto`: `vector_x` and `unroll=None`: 16 // rows K blocks per iteration (4 at most),
  their loads in flight together: the compiler's default since this benchmark;
- `tensor_core`: the prefill schedule (`QuantPrefillMatmul`: dequantize into shared memory,
  wmma), one kernel over symbolic rows, called with each row count.

`run` fills random q4k weights (scales set so values stay finite), checks every kernel's first
64 output columns against a float64 product with the weights decoded by `gguf` (the package
travels in the bundle) and rounded to f16 as the kernels round them, then times each
kernel with CUDA events (PyTorch's), rotating over enough weight copies to leave the L2, and
prints microseconds and weight GB/s. cuBLAS f16 (`torch.nn.functional.linear`, 2 bytes a
weight against q4k's 0.5625) is the reference for what the memory gives.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {"gate_up": (24576, 4096), "down": (4096, 12288)}  # (N output features, K)
ROWS = (1, 4, 16, 64)
Q4K_BLOCK, Q4K_WEIGHTS = 144, 256
VARIANTS = ("gemv", "gemv_vx", "gemv_auto", "tensor_core")


def _func(rows, n: int, k: int):
    from tvm import te

    from tallow.model_defs.quant_ops import quant_matmul_te, row_bytes

    x = te.placeholder((rows, k), "float16", name="x")
    w = te.placeholder((n, row_bytes("q4k", k)), "uint8", name="w")
    return te.create_prim_func([x, w, quant_matmul_te(x, w, "q4k", n, "float16")])


def build(out: Path) -> int:
    import tvm
    from tvm import tirx

    from tallow.compiler.cuda_build import ensure_cuda_codegen, nvcc_callback, ptxas_resources
    from tallow.schedules.gpu.quant_gemv import QuantDecodeGEMV
    from tallow.schedules.gpu.quant_prefill import QuantPrefillMatmul
    from tallow.schedules.gpu.rules import _import_tensor_intrinsics

    _import_tensor_intrinsics()
    ensure_cuda_codegen()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    rules = {
        "gemv": QuantDecodeGEMV(unroll=1),
        "gemv_vx": QuantDecodeGEMV(unroll=1, vector_x=True),
        "gemv_auto": QuantDecodeGEMV(unroll=None, vector_x=True),
        "tensor_core": QuantPrefillMatmul(),
    }
    out.mkdir(parents=True, exist_ok=True)
    resources = {}
    for variant, rule in rules.items():
        funcs = {}
        for shape, (n, k) in SHAPES.items():
            row_counts = [tirx.Var("rows", "int32")] if variant == "tensor_core" else ROWS
            for rows in row_counts:
                name = f"{variant}_{shape}" + ("" if variant == "tensor_core" else f"_r{rows}")
                sch = rule.apply(_func(rows, n, k), target, False)
                if sch is None:
                    raise SystemExit(f"{variant} declined {shape} at {rows} rows")
                funcs[name] = sch.mod["main"].with_attr("global_symbol", name)
        t = time.perf_counter()
        record: dict = {}
        with target, nvcc_callback([90], record):
            lib = tvm.tirx.build(tvm.IRModule(funcs), target=target)
        lib.export_library(str(out / f"{variant}.so"))
        resources.update(ptxas_resources(record.get("ptxas", "")))
        print(f"{variant}: {len(funcs)} kernels, {time.perf_counter() - t:.0f} s")
    (out / "resources.json").write_text(json.dumps(resources, indent=1))
    return 0


def _random_q4k(rng, n: int, k: int) -> np.ndarray:
    blocks = rng.integers(0, 256, (n * k // Q4K_WEIGHTS, Q4K_BLOCK), dtype=np.uint8)
    scales = rng.uniform(2**-12, 2**-10, (blocks.shape[0], 2)).astype(np.float16)
    blocks[:, 0:4] = scales.view(np.uint8)  # d and dmin: finite, about the size of real ones
    return blocks.reshape(n, -1)


def run(folder: Path) -> int:
    import torch
    import tvm
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from tallow.runtime.devices import device_kind

    device_kind("cuda").load_driver(tvm, "the benchmark")
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    mods = {v: tvm.runtime.load_module(str(folder / f"{v}.so")) for v in VARIANTS}
    print(f"{torch.cuda.get_device_name()}; times: median of 5 rounds of 20 calls each")
    print(f"{'shape':8} {'rows':>4} " + " ".join(f"{v:>20}" for v in (*VARIANTS, "cublas_f16")))
    worst = {}
    for shape, (n, k) in SHAPES.items():
        w = _random_q4k(rng, n, k)
        copies = max(2, -(-256 * 2**20 // w.nbytes))  # > 5x the L2 of an H100 or H200
        ws = [tvm.runtime.tensor(np.roll(w, i, axis=0), dev) for i in range(copies)]
        ref_w = dequantize(w[:64].reshape(-1), GGMLQuantizationType.Q4_K).reshape(64, k)
        ref_w = ref_w.astype(np.float16).astype(np.float64)
        wf = torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
        f16_count = max(2, -(-256 * 2**20 // (n * k * 2)))
        f16_copies = [wf] + [wf.roll(i, 0) for i in range(1, f16_count)]
        for rows in ROWS:
            x = rng.standard_normal((rows, k)).astype(np.float16)
            xt, expect = tvm.runtime.tensor(x, dev), x.astype(np.float64) @ ref_w.T
            cells = []
            for v in VARIANTS:
                name = f"{v}_{shape}" if v == "tensor_core" else f"{v}_{shape}_r{rows}"
                func = mods[v][name]
                y = tvm.runtime.tensor(np.full((rows, n), np.nan, np.float16), dev)
                func(xt, ws[0], y)
                got = y.numpy()[:, :64].astype(np.float64)
                err = float(np.linalg.norm(got - expect) / np.linalg.norm(expect))
                worst[v] = max(worst.get(v, 0.0), err if np.isfinite(err) else np.inf)
                us = _time(_launcher(func, xt, ws, y))
                cells.append(f"{us:8.1f}us {w.nbytes / us / 1e3:6.0f}GB/s")
            xf = torch.from_numpy(x).cuda()
            us = _time(_launcher(torch.nn.functional.linear, xf, f16_copies))
            cells.append(f"{us:8.1f}us {n * k * 2 / us / 1e3:6.0f}GB/s")
            print(f"{shape:8} {rows:4d} " + " ".join(f"{c:>20}" for c in cells), flush=True)
    ok = all(e < 2e-3 for e in worst.values())
    print(f"CHECK {'OK' if ok else 'FAIL'}: worst relative error per schedule {worst}")
    return 0 if ok else 1


def _launcher(func, x, weights: list, *out):
    """Call i: `func(x, weights[i % len(weights)], *out)`, the weights taking turns."""
    return lambda i: func(x, weights[i % len(weights)], *out)


def _time(call, calls: int = 20, rounds: int = 5) -> float:
    """Microseconds per call: CUDA events around `calls` back-to-back calls, median round."""
    import torch

    for i in range(3):
        call(i)
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            call(i)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / calls)
    return float(np.median(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["build", "run"])
    ap.add_argument("folder", type=Path)
    args = ap.parse_args()
    return build(args.folder) if args.command == "build" else run(args.folder)


if __name__ == "__main__":
    sys.exit(main())
