"""The entry point the Oclgrind test (`test_oclgrind.py`) and benchmarks/oclgrind_sweep.py run
under `oclgrind`: `python tests/oclgrind_harness.py CASE...` runs `opencl_cases`' small
instances by name, a planted bug (`planted_*`) or a sweep case (`sweep:...`), on whichever
OpenCL device the process sees. It prints that device first, so a caller can tell
Oclgrind's simulator really ran them.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from opencl_cases import KNOWN_FINDINGS, OCLGRIND_CASES, check_quant_matmuls

# --- planted bugs: proof that a run under Oclgrind reports what it should ------------------
_PLANTED = r"""
__kernel void shift_without_barrier(__global const float *a, __global float *out) {
    __local float tile[64];
    int i = get_local_id(0);
    tile[i] = a[i];
    barrier(CLK_LOCAL_MEM_FENCE);
    tile[i] = 2.0f * tile[i];
    /* missing barrier(CLK_LOCAL_MEM_FENCE): the neighbour may not have doubled its value */
    out[i] = tile[(i + 1) % 64];
}
__kernel void read_past_the_end(__global const float *a, __global float *out) {
    int i = get_global_id(0);
    out[i] = a[i] + a[i + 1];  /* the last work-item reads a[64] of 64 */
}
__kernel void read_unwritten_local(__global const float *a, __global float *out) {
    __local float tile[64];
    int i = get_local_id(0);
    if (i < 32) tile[i] = a[i];
    barrier(CLK_LOCAL_MEM_FENCE);
    out[i] = tile[63 - i] * 2.0f;  /* the upper half of the tile is never written */
}
"""


def planted(kernel: str) -> None:
    """Run one of `_PLANTED`'s kernels on 64 work-items in one work-group."""
    import pyopencl as cl

    device = next(d for p in cl.get_platforms() for d in p.get_devices())
    context = cl.Context([device])
    queue = cl.CommandQueue(context)
    program = cl.Program(context, _PLANTED).build()
    flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
    a = cl.Buffer(context, flags, hostbuf=np.arange(64, dtype=np.float32))
    out = cl.Buffer(context, flags, hostbuf=np.zeros(64, np.float32))
    getattr(program, kernel)(queue, (64,), (64,), a, out)
    queue.finish()


PLANTED_CASES = {
    f"planted_{k}": (lambda k=k: planted(k))
    for k in ("shift_without_barrier", "read_past_the_end", "read_unwritten_local")
}


def sweep(case: str) -> None:
    """`sweep:QTYPE:K:N:R1,R2,...`: QTYPE's decode GEMV (1 row), batched decode at each row
    count and prefill at the largest, K x N (benchmarks/oclgrind_sweep.py)."""
    _, qtype, k, n, rows = case.split(":")
    counts = [int(r) for r in rows.split(",")]
    check_quant_matmuls(
        [qtype],
        {"decode": [1], "batch_decode": counts, "prefill": [max(counts)]},
        k=int(k),
        n=int(n),
    )


def main(argv: list[str]) -> int:
    """Run the named cases (all of OCLGRIND_CASES without names), timing each."""
    import pyopencl as cl

    print("device:", next(d.name for p in cl.get_platforms() for d in p.get_devices()))
    for name in argv or list(OCLGRIND_CASES):
        start = time.perf_counter()
        known = {k: run for k, (run, _) in KNOWN_FINDINGS.items()}
        if name.startswith("sweep:"):
            sweep(name)
        else:
            {**OCLGRIND_CASES, **PLANTED_CASES, **known}[name]()
        print(f"case {name}: ok in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
