"""The larger Oclgrind sweep: every quant format's GPU-scheduled matmuls, rows 1 to 64, each
run under `oclgrind --data-races --uninitialized`, then the test's own cases; a table of
findings and times.

    .venv/bin/python benchmarks/oclgrind_sweep.py [--formats q4_0 q4k ...] [--k 512] \\
        [--n 72] [--rows 1 2 3 4 7 8 16 33 64] [--no-cases] [--jobs 1]

Per format: the decode GEMV at 1 row, batched decode at each of `--rows`, prefill at the
largest, K x N (defaults 512 x 72: no whole column tile; the PoCL test's N = 200 costs about
3x under Oclgrind). tests/test_oclgrind.py runs one format per family at 256 x 24 in a few
minutes; this is the every-format version (docs/gpu-artifacts.md#oclgrind has the times
measured). A row's "reports" counts Oclgrind's reports by kind; "result" is the harness's
own check against numpy (ok, or the first line of its failure).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

DEFAULT_ROWS = [1, 2, 3, 4, 7, 8, 16, 33, 64]


def run_case(case: str, timeout: float) -> tuple[str, dict[str, int], float, str]:
    """(case, reports by kind, seconds, result) for one harness case under Oclgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "oclgrind.log"
        cmd = ["oclgrind", "--data-races", "--uninitialized", "--log", str(log)]
        cmd += [sys.executable, str(TESTS / "oclgrind_harness.py"), case]
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            output, rc = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired:
            output, rc = f"timed out after {timeout:.0f} s", -1
        seconds = time.perf_counter() - start
        kinds: dict[str, int] = {}
        text = log.read_text() if log.exists() else ""
        for line in re.findall(r"^\S.*$", text, re.M):
            kind = re.sub(r" at .*| of size \d+.*", "", line)
            kinds[kind] = kinds.get(kind, 0) + 1
    if rc == 0:
        result = "ok"
    else:
        errors = [ln for ln in output.splitlines() if "Error" in ln or "error" in ln]
        result = (errors or output.strip().splitlines() or ["?"])[-1][:80]
    return case, kinds, seconds, result


def main() -> int:
    from opencl_cases import OCLGRIND_CASES

    from tallow.compiler.quant import QUANT_FORMATS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu_formats = [name for name, fmt in QUANT_FORMATS.items() if fmt.gpu]
    parser.add_argument("--formats", nargs="+", default=gpu_formats)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--n", type=int, default=72)
    parser.add_argument("--rows", type=int, nargs="+", default=DEFAULT_ROWS)
    parser.add_argument("--no-cases", action="store_true", help="only the format sweep")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    rows = ",".join(str(r) for r in args.rows)
    cases = [f"sweep:{q}:{args.k}:{args.n}:{rows}" for q in args.formats]
    if not args.no_cases:
        cases += list(OCLGRIND_CASES)
    print(f"{'case':<44} {'seconds':>8}  {'result':<8} reports", flush=True)
    total, clean = time.perf_counter(), True
    with ThreadPoolExecutor(args.jobs) as pool:
        for case, kinds, seconds, result in pool.map(lambda c: run_case(c, args.timeout), cases):
            found = ", ".join(f"{n} x {k}" for k, n in kinds.items()) or "none"
            clean &= not kinds and result == "ok"
            print(f"{case:<44} {seconds:>8.1f}  {result:<8} {found}", flush=True)
    print(f"total {time.perf_counter() - total:.0f} s; {'clean' if clean else 'FINDINGS'}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
