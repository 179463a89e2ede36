"""Kernel replay of a whole model, the replay half: the calls `kernel_replay.capture`
recorded on the CPU, run on the GPU-scheduled kernels (`replay_all`), compared
(`error_units`, `TOLERANCE`) and tabulated (`table`), with a reason for every kernel not
replayed. docs/gpu-artifacts.md#kernel-replay-of-a-whole-model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from kernel_replay import Call, Model
from opencl_runner import F16_TINY, F16_ULP

CACHE_REASON = (
    "a paged KV cache kernel one sequence's prefill and decode do not call (sliding window, "
    "tree attention, page copies, MLA, debug)"
)
VIEW_REASON = "not called by embed/prefill/decode (a reshape the VM runs as a view)"


def _buffer_names(func) -> list:
    """Per PrimFunc parameter: the name the runner keys its buffer by (a buffer's data
    variable, as `opencl_runner.kernel_of` spells it), or the scalar's TIR variable."""
    return [re.sub(r"\W", "_", p.name) if _is_buffer(p) else p for p in func.params]


def _is_buffer(param) -> bool:
    """TVM 0.27's PrimFunc has no buffer_map: a buffer parameter is a Var of BufferType."""
    import tvm

    return isinstance(param.ty, tvm.tirx.buffer.BufferType)


def _sizes(func, arrays: list) -> dict[str, int]:
    """The symbolic sizes of one call: each shape variable's value in the captured arrays,
    and scalar parameters as passed."""
    import tvm

    sizes = {}
    for p, value in zip(func.params, arrays, strict=True):
        if not _is_buffer(p):
            sizes[p.name] = value  # an int, or a float (`sm_scale`)
            continue
        for dim, n in zip(p.ty.shape, value.shape, strict=True):
            if isinstance(dim, tvm.tirx.Var):
                sizes[dim.name] = int(n)
    return sizes


def replay(func, runner, name: str, call: Call) -> list:
    """The GPU kernel `name` run on `call`'s arguments as they were before the CPU ran it;
    the arguments after (arrays; scalars as they were)."""
    keys = _buffer_names(func)
    arrays = {k: np.array(v) for k, v in zip(keys, call.before, strict=True) if isinstance(k, str)}
    sizes = _sizes(func, call.before)
    for kernel in runner.kernels[name]:  # the captured arrays are copies: no offsets
        sizes |= {v.name: 0 for v in kernel.sizes if v.name.endswith("_elem_offset")}
    runner.run(name, {**_scratch(func, sizes), **arrays}, sizes)
    return [arrays[k] if isinstance(k, str) else v for k, v in zip(keys, call.before, strict=True)]


def unique_params(func):
    """`func` with distinct parameter names. Relax's legalized `split` names every output
    `T_split`, and the runners key buffers by name; TVMScript prints distinct vars under
    distinct names (`T_split_1`, ...), so a print-and-parse round trip renames them."""
    import tvm

    names = [p.name for p in func.params]
    if len(set(names)) == len(names):
        return func
    return tvm.script.from_source(func.script())


_GLOBAL_ALLOC = re.compile(
    r"^\s*(\w+) = T\.sblock_alloc_buffer\(\((.*?)\)(?:, \"(\w+)\")?\)$", re.M
)


def _scratch(func, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """The global buffers a schedule allocates between its kernels (a decode GEMV's
    `cast_intermediate`, written by one kernel and read by the next), which TVM's host code
    allocates at run time: zero arrays of the shapes in `func`'s script (lines without a
    `scope`, i.e. global memory; float32 when TVMScript leaves the dtype out)."""
    out = {}
    ns = {"T": type("T", (), {"int64": staticmethod(int), "int32": staticmethod(int)})}
    for name, shape, dtype in _GLOBAL_ALLOC.findall(func.script()):
        dims = eval(f"({shape},)", ns, dict(sizes))  # noqa: S307 - TVMScript we printed
        out[name] = np.zeros(dims, dtype or "float32")
    return out


# --- the replay, kernel by kernel ----------------------------------------------------------
# An f16 result may differ from the CPU's by the f16 roundings of the few operations the
# two lowerings order or fuse differently (SiLU's exp and division, a sum's order before its
# f16 rounding), measured relative to the tensor's typical magnitude: |gpu - cpu| <=
# TOLERANCE * F16_ULP * (|cpu| + mean |cpu|). Measured at most 2.9 (SiLU); a wrong index, a
# missed row or a stale buffer is off by about |cpu|, 2048 units.
TOLERANCE = 8
WMMA = "wmma tensor cores (no WGSL or OpenCL form)"


@dataclass
class Row:
    """One kernel of the CUDA build: replayed (`max_err`, `units`) or not (`why`)."""

    kernel: str
    rule: str
    calls: int = 0
    max_err: float = 0.0  # largest |gpu - cpu| over every call and output
    units: float = 0.0  # the same in units of F16_ULP * (|cpu| + mean |cpu|)
    why: str | None = None  # not replayed: the reason
    failures: list = None


def error_units(gpu: np.ndarray, cpu: np.ndarray) -> tuple[float, float]:
    """(max |gpu - cpu|, the same in tolerance units); exact for integers and for the
    non-finite values (an unwritten buffer, e.g. the cache's free pages, may hold f16
    infinities and NaNs: they must come back as they went in), and the scale from the
    finite values only, so that such garbage cannot widen the tolerance."""
    if cpu.dtype.kind != "f":
        bad = gpu != cpu
        return (
            float(np.abs(gpu.astype(np.int64) - cpu).max()) if bad.any() else 0.0,
            np.inf if bad.any() else 0.0,
        )
    g, c = gpu.astype(np.float64), cpu.astype(np.float64)
    finite = np.isfinite(c)
    if not np.array_equal(finite, np.isfinite(g)) or not np.array_equal(
        g[~finite], c[~finite], equal_nan=True
    ):
        return np.inf, np.inf
    g, c = g[finite], c[finite]
    if not c.size:
        return 0.0, 0.0
    err = np.abs(g - c)
    scale = F16_ULP * (np.abs(c) + np.abs(c).mean()) + F16_TINY
    return float(err.max(initial=0.0)), float((err / scale).max(initial=0.0))


def unbound_blocks(func) -> list[str]:
    """Blocks of a scheduled kernel outside every `blockIdx` binding: TVM's GPU build makes
    such a loop host code (reading device memory), without an error. Read off the script's
    indentation (TVM 0.27 has no Python TIR visitor)."""
    found, stack = [], []  # (indent, bound) of the enclosing loops
    for line in func.script().splitlines():
        text = line.lstrip()
        indent = len(line) - len(text)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if text.startswith("for "):
            stack.append((indent, 'thread="blockIdx' in text))
        m = re.match(r'with T\.sblock\("(\w+)"\)', text)
        if m and m.group(1) != "root" and not any(bound for _, bound in stack):
            found.append(m.group(1))
    return found


def replay_all(model: Model, calls: list[Call], runner_class, simt=None) -> list[Row]:
    """A Row per PrimFunc of the CUDA build (sorted by name). `simt`: the same module
    scheduled without tensor cores, whose wmma kernels are replayed as `<name> (SIMT)`."""
    from opencl_cases import prim_funcs

    rules = model.report["kernels"]
    scheduled = prim_funcs(model.scheduled)
    by_kernel: dict[str, list[Call]] = {}
    for call in calls:
        by_kernel.setdefault(call.kernel, []).append(call)
    rows = []
    for name in sorted(scheduled):
        row = Row(name, rules.get(name, "?"), failures=[])
        rows.append(row)
        func = scheduled[name]
        if name not in by_kernel:
            row.why = CACHE_REASON if name in model.cache_kernels else VIEW_REASON
        elif "wmma" in func.script():
            row.why = WMMA
            if simt is not None:
                simt_row = _replay_kernel(
                    f"{name} (SIMT)",
                    simt[name],
                    by_kernel[name],
                    runner_class,
                    "SIMT: " + rules.get(name, "?"),
                )
                rows.append(simt_row)
        else:
            rows[-1] = _replay_kernel(name, func, by_kernel[name], runner_class, row.rule)
    return rows


def _replay_kernel(label: str, func, calls: list[Call], runner_class, rule: str) -> Row:
    row = Row(label, rule, failures=[])
    name = label.split()[0]
    func = unique_params(func)
    try:
        runner = runner_class({name: func})
    except Exception as e:  # noqa: BLE001 - TVM's and wgpu's own error types
        row.why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160]}"
        return row
    for call in calls:
        row.calls += 1
        out = replay(func, runner, name, call)
        for i, (gpu, cpu) in enumerate(zip(out, call.after, strict=True)):
            if isinstance(cpu, np.ndarray):
                err, units = error_units(gpu, cpu)
                row.max_err, row.units = max(row.max_err, err), max(row.units, units)
                if units > TOLERANCE:
                    row.failures.append(f"{call.step} arg {i}: max err {err:.3g} ({units:.3g})")
    return row


def simt_schedule(model: Model):
    """The wmma kernels of `model` as the same rules schedule them for a CUDA GPU without
    tensor cores (sm_60): the prefill schedule's tiles, dequantization and epilogue on SIMT
    cores, which WebGPU can run. Name -> scheduled PrimFunc."""
    import tvm
    from opencl_cases import prim_funcs

    from tallow.schedules.gpu.rules import schedule_module

    target = tvm.target.Target(
        {
            "kind": "cuda",
            "arch": "sm_60",
            "max_shared_memory_per_block": 49152,
            "max_threads_per_block": 1024,
            "thread_warp_size": 32,
        },
        host="llvm",
    )
    wmma = [n for n, f in prim_funcs(model.scheduled).items() if "wmma" in f.script()]
    mod = tvm.IRModule({gv: f for gv, f in model.fused.functions_items() if gv.name_hint in wmma})
    with target:
        return prim_funcs(schedule_module(mod, target))


def table(rows: list[Row]) -> str:
    """The kernel table the test prints (and docs/gpu-artifacts.md shows)."""
    lines = [
        "| kernel | rule | calls | max abs err | err / tol unit | replayed? |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.why:
            lines.append(f"| {r.kernel} | {r.rule} | | | | no: {r.why} |")
        else:
            ok = "MISMATCH" if r.failures else "yes"
            lines.append(
                f"| {r.kernel} | {r.rule} | {r.calls} | {r.max_err:.3g} | {r.units:.2f} | {ok} |"
            )
    return "\n".join(lines)
