"""What the CUDA decode matmuls compile to, read without a GPU: registers, instructions and
global loads per kernel, from nvcc's SASS (`gpu_gemv.py`'s schedules, q4k).

    pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm   # the disassembler, from PyPI
    .venv/bin/python benchmarks/gemv_sass.py [--rows 1 16 64] [--n 4096] [--k 4096]

A GPU is lent rarely; the SASS is a free first look at a schedule change: how many loads a
lane issues per K block (the `LDG` column divided by the blocks one loop iteration covers),
whether activations load as vectors (`LDG.E.64`), whether anything spills. It says nothing
of time: `gpu_gemv.py run` on a GPU does.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        for path in Path(root).glob(f"*/bin/{name}"):
            return str(path)
    raise SystemExit(f"{name} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def sass_of(source: str) -> tuple[str, str]:
    """(ptxas report, SASS) of one CUDA source, built for sm_90."""
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        cu.write_text(source)
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        cmd = [nvcc, "-cubin", "-arch=sm_90", "-O3", "-Xptxas", "-v", "-o", str(cubin), str(cu)]
        built = subprocess.run(cmd, capture_output=True, text=True, check=True)
        tools = Path(_tool("nvdisasm")).parent
        env = {"PATH": f"{tools}:{Path(_tool('cuobjdump')).parent}"}
        sass = subprocess.run(
            [_tool("cuobjdump"), "--dump-sass", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout
    return built.stderr, sass


def main() -> int:
    import tvm
    from gpu_gemv import _func

    from tallow.schedules.gpu.quant_gemv import QuantDecodeGEMV

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    args = ap.parse_args()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    schedules = {
        "gemv": QuantDecodeGEMV(unroll=1),
        "gemv_auto": QuantDecodeGEMV(unroll=None, vector_x=True),
    }
    print(f"{'schedule':10} {'rows':>4} {'regs':>4} {'instr':>6} {'LDG':>5} {'LDG.64+':>7} spills")
    for rows in args.rows:
        for name, rule in schedules.items():
            sch = rule.apply(_func(rows, args.n, args.k), target, False)
            mod = tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "gemv")})
            with target:
                source = tvm.tirx.build(mod, target=target).imports[0].inspect_source()
            report, sass = sass_of(source)
            ops = Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
            loads = sum(c for op, c in ops.items() if op.startswith("LDG"))
            wide = sum(c for op, c in ops.items() if re.match(r"LDG\.E\.(64|128)", op))
            regs = re.search(r"Used (\d+) registers", report)
            spills = re.search(r"(\d+) bytes spill stores", report)
            print(
                f"{name:10} {rows:4d} {regs[1] if regs else '?':>4} {sum(ops.values()):6d} "
                f"{loads:5d} {wide:7d} {spills[1] if spills else 0}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
