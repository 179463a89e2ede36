"""Run GPU-scheduled TIR kernels on the CPU: OpenCL C from TVM, launched with pyopencl on PoCL.

The kernels are scheduled exactly as a CUDA (or Metal) artifact's are (the backend's own
schedule pass, under the target it compiles for), then lowered for an OpenCL target instead
of CUDA. TVM's wheel has the OpenCL code generator (`target.build.opencl`) but not the OpenCL
runtime, so this module launches each kernel itself:

* the device kernels come from TVM's own lowering (`tvm.tirx.build`'s steps up to the code
  generator), so each kernel's parameters (buffers by name, then symbolic sizes) and its
  launch extents (`thread_extent` of `blockIdx.*` / `threadIdx.*`, expressions in those sizes)
  are read from the lowered kernel, the same facts TVM's host code launches it with;
* OpenCL's global size per axis is blocks x threads, the local size threads.

What this checks: index arithmetic, bounds predicates, shared-memory tiling and barriers, and
dequantization inside the schedule. What it cannot: CUDA-only lowering (warp shuffles: the
reductions lower to shared memory here, since OpenCL is built with a warp size of 1; wmma /
mma tensor-core intrinsics, which have no OpenCL spelling), and kernels that compute in f16
when the OpenCL device lacks `cl_khr_fp16` (Debian's PoCL 3.1 CPU device does). Reading an
f16 scale out of GGUF bytes needs no f16 arithmetic: that reinterpretation is rewritten to
`vload_half`, core OpenCL, which converts the same bits to the same float.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

# The limits CUDA kernels are scheduled under (compiler/backends/cuda.py), so nothing the
# schedule chose is rejected here; warp size 1: reductions lower to shared memory.
OPENCL_TARGET = {
    "kind": "opencl",
    "max_threads_per_block": 1024,
    "max_shared_memory_per_block": 49152,
    "thread_warp_size": 1,
}
# f16 rounding, for the f16 cases' tolerances (`opencl_cases.py`)
F16_ULP = 2.0**-11  # unit roundoff of f16 (round to nearest)
F16_TINY = 2.0**-25  # half the smallest f16 subnormal: the rounding of results near 0
_VLOAD_HALF = r"vload_half(0, (half *)(&(\1)))"
_AXES = {"x": 0, "y": 1, "z": 2}
_FP16_PRAGMA = re.compile(r"#ifdef cl_khr_fp16\n.*?#endif\n", re.S)
# f16 bits reinterpreted and converted at once: `convert_float(<bits as half>)`, or a
# broadcast `convert_floatN((halfN)(<bits as half>, ...))`.
_HALF = r"\(\*\(half \*\)\(&\((\w+)\)\)\)"
_HALF_TO_FLOAT = re.compile(rf"convert_float\({_HALF}\)")
_HALF_BROADCAST = re.compile(rf"convert_float(\d+)\(\(\(half\1\)\(({_HALF}(?:, {_HALF})*)\)\)\)")
# An f16 kernel argument (the activations of an f16 model), read only through loads converted
# to float: `convert_float(x[i])` is `vload_half(i, x)`, core OpenCL.
_HALF_PARAM = re.compile(r"__global half\* restrict (\w+)")


def unavailable() -> str | None:
    """Why OpenCL kernels cannot run here (None when they can)."""
    try:
        import pyopencl as cl
    except ImportError:
        return "needs PyPI pyopencl (test extras)"
    try:
        devices = [d for p in cl.get_platforms() for d in p.get_devices()]
    except cl.Error as e:  # no ICD loader configuration / no platform
        return f"no OpenCL platform (install Debian pocl-opencl-icd): {e}"
    if not devices:
        return "no OpenCL device (install Debian pocl-opencl-icd)"
    return None


def gpu_scheduled(mod, dtype: str = "f32", sm: int = 90, target: str = "cuda"):
    """`mod` (Relax) fused and scheduled as the `target` backend (cuda: for `--sm sm`; metal)
    does; with the backend's report (rule per kernel)."""
    import tvm

    from tallow.compiler.relax_pipeline import fusion_passes
    from tallow.compiler.target import resolve_target

    spec = resolve_target(target, dtype, [sm] if target == "cuda" else None)
    target = spec.tvm()
    with target, spec.backend.pass_context(spec):
        mod = tvm.transform.Sequential(fusion_passes())(mod)
        mod = spec.backend.schedule_pass(spec, target)(mod)
    return mod, spec.report.schedules


@dataclass
class Kernel:
    name: str
    buffers: list[tuple[str, str]]  # (buffer name, element dtype), in argument order
    sizes: list  # the symbolic sizes (TIR vars: name, dtype), after the buffers
    launch: dict[str, object]  # thread tag -> extent expression (in the sizes)


class OpenCLKernels:
    """The device kernels of scheduled PrimFuncs, built into one OpenCL program."""

    def __init__(self, prim_funcs: dict):
        import pyopencl as cl
        import tvm
        from tvm.tirx.build import codegen_build

        target = tvm.target.Target(OPENCL_TARGET, host="llvm")
        device_mod, self.kernels = lower_device_kernels(prim_funcs, target)
        self.source = codegen_build(device_mod, target).inspect_source()
        self.device = next(d for p in cl.get_platforms() for d in p.get_devices())
        self.context = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.context)
        self.program = cl.Program(self.context, self._portable(self.source)).build()
        self._launchers: dict = {}

    def _portable(self, source: str) -> str:
        if "cl_khr_fp16" in self.device.extensions:
            return source
        source = _FP16_PRAGMA.sub("", source)
        source = _HALF_BROADCAST.sub(
            lambda m: f"((float{m[1]})({re.sub(_HALF, _VLOAD_HALF, m[2])}))", source
        )
        source = _HALF_TO_FLOAT.sub(_VLOAD_HALF, source)
        for name in set(_HALF_PARAM.findall(source)):
            source = _half_local_copies(source, name)
            source = _half_vector_loads(source, name)
            source = _half_loads(source, name)
        if re.search(r"\bhalf\d*\b(?! \*\)\(&)", _HALF_PARAM.sub("", source)):
            raise RuntimeError(
                f"these kernels compute in f16, and the OpenCL device {self.device.name!r} "
                "has no cl_khr_fp16"
            )
        return source

    def run(self, name: str, arrays: dict[str, np.ndarray], sizes: dict[str, int]) -> None:
        """Launch PrimFunc `name`'s kernels in order on `arrays` (by buffer name; written back
        in place) with the symbolic `sizes` (e.g. {"b": 3})."""
        import pyopencl as cl

        flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
        device = {
            k: cl.Buffer(self.context, flags, hostbuf=np.ascontiguousarray(v))
            for k, v in arrays.items()
        }
        kernels = self.kernels[name]
        if not kernels:
            raise KeyError(f"{name} has no device kernel")
        for k in kernels:
            args = []
            for buf, dtype in k.buffers:
                if buf not in arrays:
                    raise KeyError(f"kernel {k.name} needs buffer {buf!r}; given {list(arrays)}")
                if arrays[buf].dtype != np.dtype(dtype):
                    raise TypeError(f"{buf}: {arrays[buf].dtype}, the kernel reads {dtype}")
                args.append(device[buf])
            args += [np.dtype(str(v.ty.dtype)).type(sizes[v.name]) for v in k.sizes]
            groups, local = launch_extents(k, sizes)
            if min(groups) == 0:
                continue  # an empty grid (no rows): nothing to launch
            glob = tuple(g * t for g, t in zip(groups, local, strict=True))
            self._launch(k.name, glob, tuple(local), args)
        for key, value in arrays.items():
            cl.enqueue_copy(self.queue, value, device[key])
        self.queue.finish()

    def _launch(self, name: str, glob: tuple, local: tuple, args: list) -> None:
        import pyopencl as cl

        if name not in self._launchers:
            self._launchers[name] = cl.Kernel(self.program, name)
        self._launchers[name](self.queue, glob, local, *args)


def lower_device_kernels(prim_funcs: dict, target, config: dict | None = None):
    """The device kernels of `prim_funcs` (name -> scheduled PrimFunc) lowered for `target`
    as TVM's build lowers them (the GPU builds' TIR configuration, plus `config`): (the
    device IRModule, PrimFunc name -> its `Kernel`s in launch order). Shared with
    `wgpu_runner.py`."""
    import tvm
    from tvm.tirx.build import split_host_device_mods

    from tallow.compiler.backends.gpu import GPU_TIR_CONFIG

    funcs = {name: f.with_attr("global_symbol", name) for name, f in prim_funcs.items()}
    mod = tvm.tirx.transform.BindTarget(target)(tvm.IRModule(funcs))
    pipeline, _, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
    with tvm.transform.PassContext(config={**GPU_TIR_CONFIG, **(config or {})}):
        _, device_mods = split_host_device_mods(pipeline(mod))
    (device_mod,) = device_mods.values()
    device_mod = finalize_device()(device_mod)
    kernels: dict[str, list[Kernel]] = {name: [] for name in funcs}
    for gv, func in device_mod.functions_items():
        owner = max((n for n in funcs if gv.name_hint.startswith(n + "_kernel")), key=len)
        kernels[owner].append(kernel_of(gv.name_hint, func))
    for found in kernels.values():
        found.sort(key=lambda k: k.name)
    return device_mod, kernels


def launch_extents(kernel: Kernel, sizes: dict[str, int]) -> tuple[list[int], list[int]]:
    """(work-groups, threads per group) per axis x, y, z for the given symbolic sizes."""
    local, groups = [1, 1, 1], [1, 1, 1]
    for tag, extent in kernel.launch.items():
        value = _evaluate(extent, {v: sizes[v.name] for v in kernel.sizes})
        (local if tag.startswith("threadIdx") else groups)[_AXES[tag[-1]]] = value
    return groups, local


def _half_vector_loads(source: str, name: str) -> str:
    """dlight's batched GEMV reads f16 activations as vectors into a variable of their own
    (`halfN v; if (row < b) v = vloadN(0, name + i); else v = (halfN)(0, ...);`) and uses it
    only converted, `convert_floatN(v)`: such a variable becomes a `floatN` filled by
    `vload_halfN` (core OpenCL; the same floats). A variable used in any other way is left
    as it is, and the check in `_portable` refuses it."""
    loads = re.compile(rf"(\w+) = vload(\d+)\(0, {name} \+ ")
    for var, lanes in set(loads.findall(source)):
        zero = rf"\(\(half{lanes}\)\(\(half\)0\.000000e\+00f(?:, \(half\)0\.000000e\+00f)*\)\)"
        uses = len(re.findall(rf"\b{var}\b(?! = )", source))
        converted = len(re.findall(rf"convert_float{lanes}\({var}\)", source))
        if uses != converted + source.count(f"half{lanes} {var};"):  # + its declarations
            continue
        source = source.replace(f"half{lanes} {var};", f"float{lanes} {var};")
        load = f"{var} = vload{lanes}(0, {name} + "
        source = source.replace(load, load.replace("vload", "vload_half"))
        source = re.sub(rf"{var} = {zero};", f"{var} = (float{lanes})(0.0f);", source)
    return source


def _half_local_copies(source: str, name: str) -> str:
    """`QuantDecodeGEMV(vector_x=True)` copies a lane's f16 activations into a register array
    (`half v[8]; vstore4(vload4(0, name + i), 0, v + 4);`) and reads it only converted,
    `convert_float(v[j])`: such an array becomes `float v[8]` filled by `vload_half4` (core
    OpenCL; the same floats). An array used in any other way is left for `_portable` to
    refuse."""
    copies = re.compile(rf"vstore(\d+)\(vload\1\(0, {name} \+ ([^;]*?)\), 0, (\w+) \+ \d+\);")
    for lanes, _, var in set(copies.findall(source)):
        uses = len(re.findall(rf"\b{var}\b", source))
        converted = len(re.findall(rf"convert_float\({var}\[", source))
        stores = len(re.findall(rf", 0, {var} \+ \d+\);", source))
        declared = len(re.findall(rf"half {var}\[\d+\];", source))
        if uses != converted + stores + declared:
            continue
        source = re.sub(rf"half {var}\[(\d+)\];", rf"float {var}[\1];", source)
        source = re.sub(
            rf"vstore{lanes}\(vload{lanes}\(0, {name} \+ ([^;]*?)\), 0, {var} \+ (\d+)\);",
            rf"vstore{lanes}(vload_half{lanes}(0, {name} + \1), 0, {var} + \2);",
            source,
        )
    return source


def _half_loads(source: str, name: str) -> str:
    """`convert_float(name[<index>])` -> `vload_half(<index>, name)` (brackets balanced); any
    other use of the f16 argument `name` is refused."""
    head = f"convert_float({name}["
    out, i = [], 0
    while (j := source.find(head, i)) >= 0:
        k, depth = j + len(head), 1
        while depth:
            depth += {"[": 1, "]": -1}.get(source[k], 0)
            k += 1
        if source[k] != ")":  # not a plain load converted to float: leave it
            out.append(source[i:k])
            i = k
            continue
        out.append(f"{source[i:j]}vload_half({source[j + len(head) : k - 1]}, {name})")
        i = k + 1
    source = "".join(out) + source[i:]
    if re.search(rf"\b{name}\[", source):
        raise RuntimeError(
            f"the f16 argument {name} is used beyond loads converted to float, which an "
            "OpenCL device without cl_khr_fp16 cannot run"
        )
    return source


def kernel_of(name: str, func) -> Kernel:
    import tvm

    buffers, sizes = [], []
    for p in func.params:
        if isinstance(p.ty, tvm.ir.PointerType):
            # `q4_0.weight_ptr` -> `q4_0_weight`: a parameter's name, as Python spells it
            buf = re.sub(r"\W", "_", re.sub(r"_ptr$", "", p.name))
            buffers.append((buf, str(p.ty.element_type.dtype)))
        else:
            sizes.append(p)
    launch: dict[str, object] = {}
    for node in _statements(func.body):
        if isinstance(node, tvm.tirx.AttrStmt) and node.attr_key == "thread_extent":
            tag = node.node.thread_tag
            if tag in launch and not tvm.ir.structural_equal(launch[tag], node.value):
                raise ValueError(f"{name}: {tag} launched with two extents")
            launch[tag] = node.value
    return Kernel(name, buffers, sizes, launch)


def _statements(stmt):
    """Every statement under `stmt` (TVM 0.27 has no Python TIR visitor)."""
    import tvm

    stack = [stmt]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        yield node
        if isinstance(node, tvm.tirx.SeqStmt):
            stack.extend(node.seq)
        for child in ("body", "then_case", "else_case"):
            value = getattr(node, child, None)
            if isinstance(value, tvm.tirx.Stmt):
                stack.append(value)


def _evaluate(expr, sizes: dict) -> int:
    """A launch extent for the given values of the kernel's symbolic sizes (TIR vars)."""
    import tvm
    from tvm.sym import Analyzer

    analyzer = Analyzer()
    for var, value in sizes.items():
        analyzer.bind(var, tvm.tirx.const(value, str(var.ty.dtype)))
    value = analyzer.simplify(expr)
    if not isinstance(value, tvm.tirx.IntImm):
        raise ValueError(f"launch extent {expr} is not fixed by the sizes {sizes}")
    return int(value)
