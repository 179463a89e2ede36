"""Run GPU-scheduled TIR kernels on a Vulkan device through WebGPU: WGSL from TVM's
`target.build.webgpu`, launched with PyPI `wgpu` (on a GPU-less machine: Mesa's lavapipe, a
Vulkan driver on the CPU, Debian `mesa-vulkan-drivers` + `libvulkan1`).

Why next to PoCL and Oclgrind (`opencl_runner.py`): lavapipe has `shader-f16` (f16 buffers
and arithmetic; neither OpenCL device here has `cl_khr_fp16`) and `subgroup` (the shuffles
TVM lowers cross-thread reductions to when the target has a warp size above 1; OpenCL is
built with warp size 1). Nothing of TVM's web runtime is used: the kernels are scheduled as
the CUDA backend schedules them (`opencl_runner.gpu_scheduled`), lowered by TVM's own
pipeline for a `webgpu` target (`opencl_runner.lower_device_kernels`), and launched here:

* bindings: the buffers in parameter order, then one uniform struct `PODArgs` holding the
  symbolic sizes (i32, in parameter order) and `packGridDimX` (the x work-group count, which
  the kernel compares `blockIdx.x` with);
* work-groups per axis: the `blockIdx.*` extents of the lowered kernel; the work-group size
  is compiled into the shader (`@workgroup_size`).

WGSL has no 8- or 16-bit integers, so three spellings TVM emits are rewritten (the same
values, `_portable`): a `uint8` buffer (the GGUF block bytes) is bound as `array<u32>` and
each byte read as `(word >> 8 * (i % 4)) & 255`; `u8` / `u16` values become `u32` (the
decoders keep bytes in 0..255 and half bits in 0..65535); `bitcast<f16>(bits)` becomes
`f16(unpack2x16float(bits).x)` (exact: f16 -> f32 -> f16 loses nothing; naga 0.32 rejects
`bitcast<vec2<f16>>`). `enable subgroups;` is dropped: wgpu rejects the directive, and the
subgroup builtins work once the device is requested with the `subgroup` feature.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile

import numpy as np
from opencl_runner import launch_extents, lower_device_kernels

# The limits the CUDA backend schedules under, as far as WebGPU allows: lavapipe gives 1024
# invocations and 32 KiB of workgroup memory (CUDA: 48 KiB).
_BASE_TARGET = {"kind": "webgpu", "max_num_threads": 1024, "max_shared_memory_per_block": 32768}
_LIMITS = (
    "max-compute-workgroup-storage-size",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroup-size-y",
    "max-compute-workgroup-size-z",
    "max-storage-buffers-per-shader-stage",
    "max-storage-buffer-binding-size",
    "max-buffer-size",
)
_DECL = re.compile(
    r"@group\(0\) @binding\((\d+)\) var<(storage, read|storage, read_write|uniform)>"
)
# TVM 0.27's WebGPU build first rewrites buffers to vector element types
# (`PointerValueTypeRewrite`), which fails its own check on dlight's f16 prefill matmul
# (shared tiles read as f16 pairs and as single halves at odd offsets): such a kernel is
# lowered again with its vectorized loops serial (same tiles, threads and barriers),
# recorded in `WGPUKernels.scalar`.
_VECTOR_REWRITE = "info.factor() % me->coeff == 0"
_NARROW_BUFFER = re.compile(r"var<storage, (read|read_write)> (\w+) : array<([iu](?:8|16))>")
_U8_BUFFER = re.compile(r"(var<storage, read(?:_write)?> (\w+) : array<)u8>")


def _runtime_dir() -> None:
    """The Vulkan loader and Mesa want a writable XDG_RUNTIME_DIR (else a warning per run)."""
    if not os.access(os.environ.get("XDG_RUNTIME_DIR", "/nonexistent"), os.W_OK):
        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tallow-xdg-")


@functools.cache
def device():
    """(adapter, device) with `shader-f16` and `subgroup`, at the adapter's limits."""
    import wgpu

    _runtime_dir()
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    limits = {k: adapter.limits[k] for k in _LIMITS}
    features = ["shader-f16", "subgroup"]
    return adapter, adapter.request_device_sync(required_features=features, required_limits=limits)


def unavailable() -> str | None:
    """Why WebGPU kernels cannot run here (None when they can)."""
    try:
        import wgpu
    except ImportError:
        return "needs PyPI wgpu (test extras)"
    _runtime_dir()
    try:
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    except Exception as e:  # noqa: BLE001 - wgpu raises its own types when no driver loads
        return f"no Vulkan adapter (install Debian mesa-vulkan-drivers libvulkan1): {e}"
    if adapter is None:
        return "no Vulkan adapter (install Debian mesa-vulkan-drivers libvulkan1)"
    missing = {"shader-f16", "subgroup"} - set(adapter.features)
    if missing:
        return f"the adapter {adapter.info['device']!r} lacks {sorted(missing)}"
    return None


@functools.cache
def subgroup_size() -> int:
    """The subgroup width the device runs compute shaders at, measured with the
    `subgroup_size` builtin. lavapipe: 8 (its 256-bit LLVM vectors, 8 lanes of 32 bits),
    while the adapter reports the range 4..128."""
    import wgpu

    _, dev = device()
    code = """
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32, @builtin(subgroup_size) n: u32) { out[i] = n; }
"""
    out = dev.create_buffer(size=256, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    pipeline = dev.create_compute_pipeline(
        layout="auto",
        compute={"module": dev.create_shader_module(code=code), "entry_point": "main"},
    )
    bind = dev.create_bind_group(
        layout=pipeline.get_bind_group_layout(0),
        entries=[{"binding": 0, "resource": {"buffer": out}}],
    )
    encoder = dev.create_command_encoder()
    compute = encoder.begin_compute_pass()
    compute.set_pipeline(pipeline)
    compute.set_bind_group(0, bind)
    compute.dispatch_workgroups(1)
    compute.end()
    dev.queue.submit([encoder.finish()])
    sizes = set(np.frombuffer(dev.queue.read_buffer(out), np.uint32).tolist())
    (size,) = sizes  # one width for every invocation
    return size


def webgpu_target(warp_size: int = 1):
    """A `webgpu` target whose cross-thread reductions lower for `warp_size` lanes.

    1: workgroup memory and barriers only. Above 1: subgroup shuffles. TVM 0.27's target
    canonicaliser (`UpdateWebGPUAttrs`, src/backend/webgpu/codegen/target_kind.cc) refuses a
    `thread_warp_size` above 1 without `supports_subgroups`, and with it *overwrites*
    `thread_warp_size` with 32, whatever was asked: no target built through the public API
    lowers for another subgroup width, and a shuffle reduction over 32 lanes on an 8-wide
    subgroup reads lanes that do not exist (NaN on lavapipe). So the canonical 32-lane
    target is serialised and its `thread_warp_size` set to `warp_size` in the JSON (loading
    runs no canonicaliser). `max_num_threads` becomes warp_size**2: TVM's reduction lowering
    takes the two-stage shuffle path (warps, then the warp sums in one warp) only when no
    block can hold more warps than a warp has lanes."""
    import tvm

    if warp_size == 1:
        return tvm.target.Target(_BASE_TARGET, host="llvm")
    config = {**_BASE_TARGET, "supports_subgroups": True, "max_num_threads": warp_size**2}
    graph = json.loads(tvm.ir.save_json(tvm.target.Target(config, host="llvm")))
    nodes = graph["nodes"]
    root = nodes[graph["root_index"]]["data"]
    attrs = nodes[root["attrs"]]["data"]  # [key, value, key, value, ...] node indices
    for key, value in zip(attrs[::2], attrs[1::2], strict=True):
        if nodes[key]["data"] == "thread_warp_size":
            nodes[value]["data"] = warp_size
    target = tvm.ir.load_json(json.dumps(graph))
    assert int(target.attrs["thread_warp_size"]) == warp_size, target
    return target


class WGPUKernels:
    """The device kernels of scheduled PrimFuncs as WGSL compute pipelines; `run` like
    `opencl_runner.OpenCLKernels.run`. `warp_size`: see `webgpu_target`; above 1, kernels
    whose subgroup code cannot be right at that width are refused (`_refuse_wrong_lanes`)
    unless `checked` is False."""

    def __init__(self, prim_funcs: dict, warp_size: int = 1, checked: bool = True):
        import tvm

        self.checked = checked  # False: build subgroup code `_refuse_wrong_lanes` refuses
        target = webgpu_target(warp_size)
        self.kernels, self.sources, self.scalar, self.source = {}, {}, [], ""
        for name, func in prim_funcs.items():
            try:
                source = self._build(name, func, target, {})
            except tvm.error.InternalError as e:
                if _VECTOR_REWRITE not in str(e):
                    raise
                source = self._build(name, func, target, {"tirx.disable_vectorize": True})
                self.scalar.append(name)
            self.source += source
            for kernel, code in re.findall(
                r"// Function: (\w+)\n(.*?)(?=\n// Function: |\Z)", source, re.S
            ):
                self.sources[kernel] = _portable(code)
        self.adapter, self.device = device()
        self._pipelines: dict = {}

    def _build(self, name: str, func, target, config: dict) -> str:
        from tvm.tirx.build import codegen_build

        device_mod, kernels = lower_device_kernels({name: func}, target, config)
        source = codegen_build(device_mod, target).inspect_source()
        warp_size = int(target.attrs["thread_warp_size"])
        if warp_size > 1 and self.checked:
            _refuse_wrong_lanes(name, device_mod, source, warp_size)
        self.kernels.update(kernels)
        return source

    def _pipeline(self, name: str):
        if name not in self._pipelines:
            code = self.sources[name]
            module = self.device.create_shader_module(code=code)
            pipeline = self.device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": name}
            )
            self._pipelines[name] = (pipeline, [int(b) for b, _ in _DECL.findall(code)])
        return self._pipelines[name]

    def run(self, name: str, arrays: dict[str, np.ndarray], sizes: dict[str, int]) -> None:
        """Launch PrimFunc `name`'s kernels in order on `arrays` (by buffer name; written back
        in place) with the symbolic `sizes` (e.g. {"b": 3})."""
        import wgpu

        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        buffers = {}
        for key, value in arrays.items():
            data = np.ascontiguousarray(value).tobytes()
            data += b"\0" * (-len(data) % 4 or (4 if not data else 0))  # whole 32-bit words
            buffers[key] = self.device.create_buffer_with_data(data=data, usage=usage)
        kernels = self.kernels[name]
        if not kernels:
            raise KeyError(f"{name} has no device kernel")
        encoder = self.device.create_command_encoder()
        for k in kernels:
            entries = []
            for i, (buf, dtype) in enumerate(k.buffers):
                if buf not in arrays:
                    raise KeyError(f"kernel {k.name} needs buffer {buf!r}; given {list(arrays)}")
                if arrays[buf].dtype != np.dtype(dtype):
                    raise TypeError(f"{buf}: {arrays[buf].dtype}, the kernel reads {dtype}")
                entries.append({"binding": i, "resource": {"buffer": buffers[buf]}})
            groups, _ = launch_extents(k, sizes)
            if min(groups) == 0:
                continue  # an empty grid (no rows): nothing to launch
            if groups[2] != 1 or groups[0] >= 1 << 16:
                raise ValueError(f"{k.name}: grid {groups} (blockIdx.z is WebGPU's own)")
            pod = [_pod_word(sizes[v.name], v) for v in k.sizes] + [groups[0]]  # packGridDimX
            words = np.zeros(-(-len(pod) // 4) * 4, np.int32)  # a uniform: 16-byte multiples
            words[: len(pod)] = pod
            uniform = self.device.create_buffer_with_data(
                data=words.tobytes(), usage=wgpu.BufferUsage.UNIFORM
            )
            entries.append({"binding": len(k.buffers), "resource": {"buffer": uniform}})
            pipeline, used = self._pipeline(k.name)
            bind = self.device.create_bind_group(
                layout=pipeline.get_bind_group_layout(0),
                entries=[e for e in entries if e["binding"] in used],
            )
            compute = encoder.begin_compute_pass()
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, bind)
            compute.dispatch_workgroups(*groups)
            compute.end()
        self.device.queue.submit([encoder.finish()])
        for key, value in arrays.items():
            data = self.device.queue.read_buffer(buffers[key])
            flat = np.frombuffer(data, value.dtype, count=value.size)
            value[...] = flat.reshape(value.shape)


def _pod_word(value, var) -> int:
    """One scalar of the uniform `PODArgs`: an integer as it is, a float32 parameter (the
    attention kernels' `sm_scale`, `rope_theta`) as its bits."""
    if str(var.ty.dtype).startswith("float"):
        return int(np.array(value, np.float32).view(np.int32))
    return int(value)


def _refuse_wrong_lanes(name: str, device_mod, source: str, warp_size: int) -> None:
    """Refuse (NotImplementedError, naming the kernel) subgroup code that cannot be right on
    a `warp_size`-wide subgroup, rather than run it:

    * a shuffle by `warp_size` or more lanes, or a broadcast from a lane that is not a
      constant below `warp_size`: TVM's two-stage reduction (each warp, then the warps' sums
      in one warp) needs at most `warp_size` warps, which it takes for granted when the
      target's `max_num_threads` is at most `warp_size**2` (`webgpu_target` sets that so the
      path is taken at all); a kernel reducing over more threads (RMSNorm's 512) then
      shuffles across lanes that do not exist. (CUDA's 32 lanes and 1024 threads meet the
      rule; lavapipe's 8 lanes and the CUDA schedules' 128 to 1024 threads do not.)
    * a reduction lowered to shared memory with a warp-synchronous tail (steps separated by
      `tvm_storage_sync("warp")`, lock-step within a warp assumed): in WGSL
      `workgroupBarrier()` inside a branch only some invocations take."""
    for gv, func in device_mod.functions_items():
        if re.search(r'tvm_storage_sync\("warp"\)', func.script()):
            raise NotImplementedError(
                f"{gv.name_hint}: a reduction lowered to shared memory with a "
                "warp-synchronous tail (no WGSL equivalent)"
            )
    for call, lane in re.findall(r"(subgroupShuffle\w*)\([^;]*?, u32\(([^;]*?)\)\)", source):
        if not re.fullmatch(r"\d+i", lane) or int(lane[:-1]) >= warp_size:
            raise NotImplementedError(
                f"{name}: {call}(..., {lane}) on a {warp_size}-lane subgroup: a reduction "
                f"over more than {warp_size}**2 threads, or a broadcast lane TVM does not "
                "reduce modulo the subgroup"
            )


def _byte_reads(source: str, name: str) -> str:
    """`name[<index>]` -> `(name[(<index>) / 4] >> (8 * ((<index>) % 4))) & 255` (brackets
    balanced): byte `index` of a buffer bound as 32-bit words, little-endian."""
    head = f"{name}["
    out, i = [], 0
    while (j := source.find(head, i)) >= 0:
        if j and (source[j - 1].isalnum() or source[j - 1] == "_"):
            out.append(source[i : j + len(head)])
            i = j + len(head)
            continue
        k, depth = j + len(head), 1
        while depth:
            depth += {"[": 1, "]": -1}.get(source[k], 0)
            k += 1
        index = f"u32({source[j + len(head) : k - 1]})"
        out.append(f"{source[i:j]}(({name}[{index} >> 2u] >> (({index} & 3u) << 3u)) & 255u)")
        i = k
    return "".join(out) + source[i:]


def _portable(source: str) -> str:
    """TVM's WGSL, spelled for a WGSL compiler (wgpu's naga): see the module docstring.
    Buffers of 8- or 16-bit integers other than read-only bytes are refused: a written
    byte or half-word would be a read-modify-write of a shared 32-bit word (a race between
    invocations), and TVM stores bf16 as u16 (its bf16 legalisation for targets without
    bf16), which would need the same."""
    for access, name, dtype in _NARROW_BUFFER.findall(source):
        if access != "read" or dtype != "u8":
            raise NotImplementedError(
                f"buffer {name}: array<{dtype}> ({access}); WGSL has no 8- or 16-bit "
                "integers (bf16 is stored as u16)"
            )
    source = source.replace("enable subgroups;\n", "")
    for _, name in _U8_BUFFER.findall(source):
        source = _byte_reads(source, name)
    source = _U8_BUFFER.sub(r"\1u32>", source)
    source = source.replace("bitcast<f16>(", "_f16_bits(")
    if "_f16_bits(" in source:
        # naga 0.32 miscompiles `bitcast<vec2<f16>>`; every f16 is exact in f32
        source += "\nfn _f16_bits(bits: u32) -> f16 { return f16(unpack2x16float(bits).x); }\n"
    return re.sub(r"\bu(8|16)\b", "u32", source)
