"""A fused projection whose parts differ in format: one kernel per run against one kernel.

    TVM_NUM_THREADS=2 .venv/bin/python benchmarks/split_projection.py
    TVM_NUM_THREADS=2 .venv/bin/python benchmarks/split_projection.py \
        --hidden 576 --parts 576 192 192

The q/k/v projection of one layer (by default Qwen2.5-0.5B's: hidden 896, 14 query / 2 KV
heads of 64, so parts of 896, 128 and 128 rows; the second line is SmolLM2-135M's) built
through tallow's whole Relax pipeline (fusion, the CPU schedules, the int8-activation decode
kernels) as a `decode` function ([1, 1, hidden], one token) and a `batch_decode` one
([batch, 1, hidden]), each variant's weights cycled through 24 copies (one per layer, as a
decode step reads them). Variants:

* `fused q8_0`: all three parts in one format, one kernel (what a uniform file gets);
* `split q8_0 x3`: the same weights as three runs, three kernels and a concatenation: the
  cost of the split itself (calls and the copy of the output);
* `split q5_0+q8_0`: q/k in Q5_0, v in Q8_0, as llama.cpp's Q4_K_M gives that model: two
  runs (`model_defs.projections.SplitProjection`);
* `float f32`: the same projection dequantized to float32, what such a weight became before
  the split.

Prints the best time per call (microseconds) of each at batch 1 and 16, over interleaved
rounds (the machine is shared: the best round is the least disturbed one).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import tvm
from tvm.relax.frontend import nn

from tallow.compiler.quant import quantize
from tallow.compiler.relax_pipeline import lower_module
from tallow.compiler.target import resolve_target
from tallow.model_defs.projections import SplitProjection
from tallow.model_defs.quant_ops import QuantLinear

LAYERS = 24


class _Projection(nn.Module):
    def __init__(self, proj: nn.Module):
        self.proj = proj

    def decode(self, x):
        return self.proj(x)

    def batch_decode(self, x):
        return self.proj(x)


def _module(kind: str, hidden: int, parts: tuple[int, ...]) -> nn.Module:
    rows = sum(parts)
    if kind == "fused q8_0":
        return QuantLinear(hidden, rows, "q8_0")
    if kind == "split q8_0 x3":
        return SplitProjection(hidden, parts, ("q8_0",) * 3, "float32", bias=False)
    if kind == "split q5_0+q8_0":
        return SplitProjection(hidden, parts, ("q5_0", "q5_0", "q8_0"), "float32", bias=False)
    return nn.Linear(hidden, rows, bias=False, dtype="float32")


VARIANTS = ("fused q8_0", "split q8_0 x3", "split q5_0+q8_0", "float f32")


def _owner(model: nn.Module, name: str) -> nn.Module:
    """The module holding parameter `name` ("proj.runs.1.weight" -> model.proj.runs[1])."""
    for part in name.split(".")[:-1]:
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def _weights(model: nn.Module, named_params, rng) -> list:
    """Values for the parameters: random rows quantized in their run's format, or float32."""
    out = []
    for name, p in named_params:
        rows = int(p.shape[0])
        owner = _owner(model, name)
        w = rng.standard_normal((rows, owner.in_features)).astype(np.float32)
        out.append(quantize(w, owner.qtype) if str(p.dtype) == "uint8" else w)
    return out


def _build(kind: str, spec, folder: Path, hidden: int, parts: tuple[int, ...]):
    model = _Projection(_module(kind, hidden, parts))
    packed = {"param_mode": "packed", "effect_mode": "none"}
    specs = {
        "decode": {"x": nn.spec.Tensor([1, 1, hidden], "float32"), "$": packed},
        "batch_decode": {"x": nn.spec.Tensor(["b", 1, hidden], "float32"), "$": packed},
    }
    mod, named_params = model.export_tvm(spec=specs)
    mod = lower_module(mod, spec)
    path = folder / f"{kind.replace(' ', '_').replace('+', '_')}.so"
    spec.backend.build(mod, spec, path)
    vm = tvm.relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())
    return vm, model, named_params


def _time_us(f, x, params: list, repeat: int) -> float:
    t = time.perf_counter()
    for _ in range(repeat):
        for p in params:
            f(x, p)
    return (time.perf_counter() - t) / (repeat * len(params)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--hidden", type=int, default=896, help="input features")
    ap.add_argument("--parts", type=int, nargs=3, default=[896, 128, 128], help="q, k and v rows")
    args = ap.parse_args()
    hidden, parts = args.hidden, tuple(args.parts)
    spec = resolve_target("cpu", "f32")
    rng = np.random.default_rng(0)
    x1 = tvm.runtime.tensor(rng.standard_normal((1, 1, hidden)).astype(np.float32))
    x16 = tvm.runtime.tensor(rng.standard_normal((16, 1, hidden)).astype(np.float32))
    with tempfile.TemporaryDirectory() as tmp:
        built = {}
        for kind in VARIANTS:
            vm, model, named = _build(kind, spec, Path(tmp), hidden, parts)
            params = [
                [tvm.runtime.tensor(w) for w in _weights(model, named, rng)] for _ in range(LAYERS)
            ]
            built[kind] = (vm, params)
        # Interleaved rounds, best of each: the machine is shared, and a variant timed while
        # another job runs would otherwise look slow.
        best = {(k, b): float("inf") for k in VARIANTS for b in (1, 16)}
        for _ in range(args.rounds):
            for kind, (vm, params) in built.items():
                for b, x, f in ((1, x1, vm["decode"]), (16, x16, vm["batch_decode"])):
                    us = _time_us(f, x, params, args.repeat)
                    best[kind, b] = min(best[kind, b], us)
    print(f"q/k/v projection {hidden} -> {'+'.join(map(str, parts))}, {LAYERS} weight copies")
    print(f"{'variant':>16} {'batch 1 (us)':>13} {'batch 16 (us)':>14}")
    for kind in VARIANTS:
        print(f"{kind:>16} {best[kind, 1]:>13.1f} {best[kind, 16]:>14.1f}")


if __name__ == "__main__":
    main()
