"""Kernel replay of a whole model: every kernel of one prefill and one decode step of a tiny
f16 q4k Qwen3, as a CUDA artifact runs it, on its GPU schedule lowered for WebGPU (lavapipe),
fed the inputs a CPU run of the same kernels saw, compared kernel by kernel
(docs/gpu-artifacts.md#kernel-replay-of-a-whole-model).

Why: with no GPU, the per-kernel checks (`opencl_cases.py`) feed synthetic inputs to kernels
built from small modules. A whole-model replay feeds each kernel what the model really gives
it (activations after real norms and attention, real q4k/q6k blocks) and covers every fused
kernel the CUDA build runs, not only those a case was written for.

* The kernel set: the model exported for `cuda` (sm_80), fused as the CUDA backend fuses it
  (`relax_pipeline.fusion_passes` in the backend's pass context), then scheduled by its
  schedule pass: the PrimFuncs a CUDA build runs, by name.
* The oracle: the same fused module, unscheduled, built for `llvm` by TVM's default CPU
  lowering and run by the Relax VM (`STEPS`: a 17-token prefill, a second 5-token chunk,
  one decode step); the VM's instrument hook copies every kernel call's arguments before
  and after the call. The paged KV cache's own kernels (attention, append, merge, its
  RoPE) are called by the cache's C++ runtime, not by the VM: the cache is the one the
  same model builds for `llvm` (its CPU kernels), handed recording wrappers in place of
  its kernels (`_through_recorders`), so those calls are captured too and replayed on the
  CUDA build's kernels of the same position in the cache's argument list.
* The replay: each call's captured arguments (output buffers as they were before the call)
  given to the GPU-scheduled kernel on wgpu (`wgpu_runner.WGPUKernels`); every buffer after
  the run compared with the CPU's after its call (`error_units`, `TOLERANCE`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from opencl_runner import F16_TINY, F16_ULP

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 120, 31, 2, 77, 19, 200, 45]  # 17: two pages
# (step, function, tokens): the prompt; a second chunk of it, which attends to the cached
# pages too (paged prefill, ragged prefill, and the merge of the two); one decode step
STEPS = (
    ("prefill", "prefill", PROMPT),
    ("prefill chunk 2", "prefill", [33, 150, 9, 4, 61]),
    ("decode", "decode", [123]),
)
FUNCTIONS = ("embed", "prefill", "decode", "create_paged_kv_cache")
# the paged cache's kernels are checked against numpy in f32 on PoCL and Oclgrind instead
# (opencl_paged_kv.py)
CACHE_REASON = (
    "a paged KV cache kernel one sequence's prefill and decode do not call (sliding window, "
    "tree attention, page copies, MLA, debug)"
)
VIEW_REASON = "not called by embed/prefill/decode (a reshape the VM runs as a view)"


@dataclass
class Call:
    """One kernel call of the CPU run: its arguments before and after the call."""

    step: str  # a label of `STEPS`
    kernel: str
    before: list  # np.ndarray, or a Python int/float, per PrimFunc parameter
    after: list


@dataclass
class Model:
    fused: object  # IRModule: fused, unscheduled (the CUDA build's kernels)
    scheduled: object  # the same, scheduled by the CUDA backend
    cpu: object  # the llvm Executable of `fused` (the cache's kernels swapped)
    cache_kernels: list[str]  # the paged KV cache's kernels in the CUDA build
    params: list  # weights (np.ndarray) in parameter order
    report: dict  # the CUDA backend's schedule report (rule per kernel)
    cache_map: dict  # the cache's kernels: CUDA build's name -> the llvm cache's name


RECORDER = "tallow.kernel_replay."  # + a cache kernel's CUDA name: its recording wrapper


def _cache_args(func) -> list:
    """The kernels (GlobalVars) among the arguments of `create_paged_kv_cache`'s call to
    `vm.builtin.paged_attention_kv_cache_create`, in argument order."""
    from tvm import relax

    (binding,) = [b for block in func.body.blocks for b in block.bindings]
    found = []
    for arg in binding.value.args:
        items = arg.fields if isinstance(arg, relax.Tuple) else [arg]
        found += [x for x in items if isinstance(x, relax.GlobalVar)]
    return found


def _through_recorders(cpu_mod, gpu_mod):
    """The llvm cache's `create_paged_kv_cache` handing the cache a recording wrapper
    (`RECORDER` + the CUDA kernel's name, registered by `capture`) in place of each kernel,
    so the calls the cache's C++ runtime makes are seen too; and CUDA name -> llvm name.
    The two caches take the same arguments in the same order (the kernels differ)."""
    from tvm import relax

    cpu_func = cpu_mod["create_paged_kv_cache"]
    pairs = list(
        zip(_cache_args(gpu_mod["create_paged_kv_cache"]), _cache_args(cpu_func), strict=True)
    )
    by_cpu = {c.name_hint: g.name_hint for g, c in pairs}

    @relax.expr_functor.mutator
    class Swap(relax.PyExprMutator):
        def visit_global_var_(self, op):
            name = by_cpu.get(op.name_hint)
            return relax.ExternFunc(RECORDER + name) if name else op

    return Swap().visit_expr(cpu_func), {g: c for c, g in by_cpu.items()}


def prim_names(mod) -> list[str]:
    import tvm

    return [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]


def _cache_kernels(mod) -> set[str]:
    """The PrimFuncs `create_paged_kv_cache` hands to the cache's runtime."""
    words = set(re.findall(r"\w+", mod["create_paged_kv_cache"].script()))
    return words & set(prim_names(mod))


def build(model_dir, quant: str = "q4k", sm: int = 80) -> Model:
    """The tiny model at `model_dir`, f16 with `quant` weights, as the CUDA backend fuses and
    schedules it; its CPU oracle build; its weights (converted as `tallow compile` does)."""
    import tvm

    from tallow.compiler import phases
    from tallow.compiler.libraries import resolve_targets
    from tallow.compiler.pipeline import CompileOptions, CompileState
    from tallow.compiler.progress import Progress
    from tallow.compiler.relax_pipeline import fusion_passes, vm_lowering_passes
    from tallow.compiler.target import DTYPES
    from tallow.compiler.weights import ParamSpec, _converted

    opts = CompileOptions(
        model=str(model_dir), target="cuda", sms=[sm], dtype="f16", quant=quant, quiet=True
    )
    state = CompileState(options=opts, progress=Progress(quiet=True))
    state.targets = resolve_targets(opts)
    phases.read_model(state)

    def export(target, functions):
        module = state.architecture.build(
            state.config,
            DTYPES[state.options.dtype],
            target,
            quant=state.quant_plan.module_types(),
            task="generate",
            kv_dtype=DTYPES[state.options.kv_dtype],
        )
        spec = module.get_default_spec()
        return module.export_tvm(spec={f: spec[f] for f in functions})

    spec = state.target
    mod, named = export(spec.tvm(), FUNCTIONS)
    params = [ParamSpec(n, tuple(int(d) for d in p.shape), str(p.dtype)) for n, p in named]
    weights = [
        a for _, a in _converted(params, state.weight_map, state.checkpoint, state.quant_plan)
    ]
    with spec.tvm(), spec.backend.pass_context(spec):
        fused = tvm.transform.Sequential(fusion_passes())(mod)
        # the schedule pass rewrites the module it is given: schedule a copy
        copy = tvm.IRModule(dict(fused.functions_items()), attrs=fused.attrs)
        scheduled = spec.backend.schedule_pass(spec, spec.tvm())(copy)

    # the CPU oracle: the fused CUDA module, its cache's kernels taken from an llvm export
    llvm = tvm.target.Target("llvm")
    with llvm:
        cpu_cache_mod = export(llvm, ["create_paged_kv_cache"])[0]
        cpu_cache_mod = tvm.transform.Sequential(fusion_passes())(cpu_cache_mod)
    gpu_cache = _cache_kernels(fused) | {"create_paged_kv_cache"}
    cpu_cache = _cache_kernels(cpu_cache_mod) | {"create_paged_kv_cache"}
    funcs = {gv: f for gv, f in fused.functions_items() if gv.name_hint not in gpu_cache}
    funcs.update({gv: f for gv, f in cpu_cache_mod.functions_items() if gv.name_hint in cpu_cache})
    create, cache_map = _through_recorders(cpu_cache_mod, fused)
    funcs[cpu_cache_mod.get_global_var("create_paged_kv_cache")] = create
    with llvm:
        cpu_mod = tvm.transform.Sequential(vm_lowering_passes())(tvm.IRModule(funcs))
        cpu = tvm.compile(cpu_mod, llvm, relax_pipeline=None)
    return Model(
        fused,
        scheduled,
        cpu,
        sorted(gpu_cache - {"create_paged_kv_cache"}),
        weights,
        spec.report.schedules,
        cache_map,
    )


def _host(value):
    """A copy of one VM call argument: tensors as numpy, scalars as Python numbers."""
    import tvm

    if isinstance(value, tvm.runtime.Tensor):
        return value.numpy().copy()
    return value


def _recorder(name: str, kernel, calls: list, step: list):
    def record(*args):
        before = [_host(a) for a in args]
        kernel(*args)
        calls.append(Call(step[0], name, before, [_host(a) for a in args]))

    return record


def capture(model: Model) -> list[Call]:
    """Run `embed` + each step's function (`STEPS`) on the CPU; every call of one of the
    module's kernels (the VM's, and the paged cache's through `_through_recorders`), with
    its arguments before and after."""
    import tvm
    from tvm import relax

    kernels = set(prim_names(model.fused)) - set(model.cache_kernels)
    calls: list[Call] = []
    pending: list = []
    step = ["prefill"]
    for gpu_name, cpu_name in model.cache_map.items():
        kernel = model.cpu.mod.get_function(cpu_name, True)
        record = _recorder(gpu_name, kernel, calls, step)
        tvm.register_global_func(RECORDER + gpu_name, record, override=True)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(model.cpu, dev)
    params = [tvm.runtime.tensor(w, dev) for w in model.params]

    def instrument(func, name, before_run, ret_value, *args):
        if name in kernels:
            if before_run:
                pending.append([_host(a) for a in args])
            else:
                calls.append(Call(step[0], name, pending.pop(), [_host(a) for a in args]))
        return 0

    vm.set_instrument(instrument)
    shape = tvm.runtime.ShapeTuple
    cache = vm["create_paged_kv_cache"](
        shape([1]), shape([64]), shape([64]), shape([16]), shape([0])
    )
    get = tvm.get_global_func
    get("vm.builtin.kv_state_add_sequence")(cache, 0)
    for label, name, tokens in STEPS:
        step[0] = label
        ids = tvm.runtime.tensor(np.array(tokens, np.int32), dev)
        embeds = vm["embed"](ids, params)
        embeds = embeds._create_view((1, len(tokens), embeds.shape[-1]))
        get("vm.builtin.kv_state_begin_forward")(cache, shape([0]), shape([len(tokens)]))
        vm[name](embeds, cache, params)
        get("vm.builtin.kv_state_end_forward")(cache)
    return calls


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
