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
* The replay (`kernel_replay_check.py`): each call's captured arguments (output buffers as
  they were before the call) given to the GPU-scheduled kernel on wgpu
  (`wgpu_runner.WGPUKernels`); every buffer after the run compared with the CPU's after
  its call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 120, 31, 2, 77, 19, 200, 45]  # 17: two pages
# (step, function, tokens): the prompt; a second chunk of it, which attends to the cached
# pages too (paged prefill, ragged prefill, and the merge of the two); one decode step
STEPS = (
    ("prefill", "prefill", PROMPT),
    ("prefill chunk 2", "prefill", [33, 150, 9, 4, 61]),
    ("decode", "decode", [123]),
)
FUNCTIONS = ("embed", "prefill", "decode", "create_paged_kv_cache")


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
