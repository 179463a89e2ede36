"""Ahead-of-time CUDA builds on a machine without a GPU or a CUDA driver.

Two problems, two small fixes, both confined to the build phase:

1. **One library, SASS for several architectures.** TVM's codegen hands the generated CUDA
   source to the global callback `tvm_callback_cuda_compile` and stores whatever bytes come
   back in the CUDA module. TVM's own callback compiles for the single `arch` of the target
   (and defaults to NVRTC, which needs the `cuda-bindings` package). We register our own
   callback for the duration of the build (`nvcc_callback`): nvcc with one `-gencode` per
   requested arch, emitting a *fatbin*. The driver picks the matching SASS at load time,
   so one `model.so` serves e.g. A100 (sm_80) and H100/H200 (sm_90). We emit SASS only
   (no PTX): the artifact then runs exactly where it was tested, never JIT-compiled.
   The TIR itself is scheduled once, for the *lowest* requested arch (see target.py).

2. **No `libcuda.so.1`.** Creating the CUDA module object at build time needs TVM's
   `libtvm_runtime_cuda.so`, which is linked against the driver library `libcuda.so.1`; on
   a GPU-less build box (CI) the dynamic loader refuses it and TVM silently skips it, so
   the build fails with "ffi.Module.create.cuda not found". Only if no driver can be
   loaded, we compile a stub `libcuda.so.1` with the system C compiler into a cache folder
   and load it before `libtvm_runtime_cuda.so`: the loader then resolves the `cu*` symbols
   against the stub. The build never calls them (it only wraps bytes in a module object);
   if anything did, every stub returns CUDA_ERROR_NO_DEVICE. Nothing is installed system-
   wide, no environment variable is needed, and the stub is never used at run time (the
   runtime process loads the real driver; `runtime/model_runner.py` does not use this).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tallow.runtime.errors import TargetError

# The driver-API symbols libtvm_runtime_cuda.so imports (`nm -D --undefined-only`, TVM 0.27).
# ctypes loads with RTLD_NOW, so each must exist; a newer wheel needing more fails loudly below.
_DRIVER_SYMBOLS = (
    "cuDeviceGetName",
    "cuFuncSetAttribute",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuLaunchKernelEx",
    "cuModuleGetFunction",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuTensorMapEncodeTiled",
)
_CUDA_ERROR_NO_DEVICE = 100

_stub_state: dict[str, str] = {}  # "driver": "system" | "stub:<path>"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tallow" / "cuda-stub"


def _build_stub() -> Path:
    source = "/* tallow: build-time stand-in for libcuda.so.1; never used to run kernels */\n"
    source += "\n".join(
        f"int {s}(void) {{ return {_CUDA_ERROR_NO_DEVICE}; }}" for s in _DRIVER_SYMBOLS
    )
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    out = _cache_dir() / digest / "libcuda.so.1"
    if out.is_file():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise TargetError("building for CUDA without a driver needs a C compiler (cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / "stub.c", Path(tmp) / "libcuda.so.1"
        src.write_text(source + "\n")
        cmd = [cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise TargetError(f"could not build the libcuda stub: {proc.stderr.strip()}")
        os.replace(lib, out)  # atomic: concurrent compiles never see half a file
    return out


def ensure_cuda_codegen() -> str:
    """Make TVM's CUDA module type available in this process; say how ("system" or "stub")."""
    import tvm
    import tvm_ffi
    from tvm.base import _LOADED_LIBS

    if tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is not None:
        return _stub_state.setdefault("driver", "system")
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        _stub_state["driver"] = "system"
    except OSError:
        stub = _build_stub()
        ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)  # soname libcuda.so.1 now resolves
        _stub_state["driver"] = f"stub:{stub}"
    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    try:
        _LOADED_LIBS["tvm_runtime_cuda"] = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        hint = ""
        if "undefined symbol: cu" in str(e):
            hint = " (this TVM needs more driver symbols: extend _DRIVER_SYMBOLS)"
        raise TargetError(f"cannot load TVM's CUDA runtime for the build: {e}{hint}") from e
    if tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is None:
        raise TargetError("TVM's CUDA runtime loaded but registered no CUDA module type")
    return _stub_state["driver"]


def nvcc_version() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "missing"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def nvcc_fatbin(code: str, archs: list[int], record: dict | None = None) -> bytes:
    """Compile CUDA source to one fatbin holding SASS for every arch in `archs`.

    `record["ptxas"]` gets ptxas's verbose report (`-Xptxas -v`: registers, spills and
    shared memory of every kernel for every arch), parsed by `ptxas_resources`. Kernels that
    spill are compiled once more with an explicit minimum of blocks per SM
    (`launch_bounds.py`); `record["spill_repair"]` then says which, with the spill bytes
    before and the bound given, and `record["ptxas"]` is the report of the final build."""
    from . import launch_bounds

    data, report = _nvcc(code, archs)
    before = launch_bounds.spilling(ptxas_resources(report))
    if before:
        blocks = launch_bounds.min_blocks(code, ptxas_resources(report), before)
        code = launch_bounds.with_min_blocks(code, {k: b for k, (_, b) in blocks.items()})
        data, report = _nvcc(code, archs)
        if record is not None:
            record["spill_repair"] = {
                k: {"spill_stores_before": before[k], "threads": threads, "min_blocks_per_sm": b}
                for k, (threads, b) in sorted(blocks.items())
            }
    if record is not None:
        record["ptxas"] = report
        record["cuda_source"] = code
    return data


def _nvcc(code: str, archs: list[int]) -> tuple[bytes, str]:
    """(fatbin bytes, ptxas's -v report) of one nvcc run over `code`."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise TargetError("compiling for CUDA needs nvcc (the CUDA toolkit) on PATH")
    with tempfile.TemporaryDirectory(prefix="tallow-nvcc-") as tmp:
        src, out = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.fatbin"
        src.write_text(code)
        cmd = [nvcc, "--fatbin", "-O3", "-Xptxas", "-v", "-o", str(out), str(src)]
        for sm in archs:
            cmd += ["-gencode", f"arch=compute_{sm},code=sm_{sm}"]
        # The same dialect flags TVM's generated code expects from its own nvcc path.
        cmd += [
            "-U__CUDA_NO_HALF_OPERATORS__",
            "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__",
            "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT162_OPERATORS__",
            "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
            "--expt-relaxed-constexpr",
            "--use_fast_math",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise TargetError(f"nvcc failed:\n{proc.stdout}{proc.stderr}"[-4000:])
        data = out.read_bytes()
    if not data:
        raise TargetError("nvcc produced an empty fatbin")
    return data, proc.stdout + proc.stderr


@contextlib.contextmanager
def nvcc_callback(archs: list[int], record: dict | None = None):
    """Route TVM's CUDA compile hook to `nvcc_fatbin(archs)` while the block runs."""
    import tvm_ffi

    name = "tvm_callback_cuda_compile"
    previous = tvm_ffi.get_global_func(name, allow_missing=True)
    calls = []

    def compile_hook(code, *_target):
        calls.append(len(code))
        return bytearray(nvcc_fatbin(code, archs, record))

    tvm_ffi.register_global_func(name, compile_hook, override=True)
    try:
        yield calls
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_PTXAS_FIELDS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "smem_bytes": re.compile(r"(\d+) bytes smem"),
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def ptxas_resources(report: str) -> dict[str, dict[str, dict[str, int]]]:
    """{kernel: {arch: {registers, smem_bytes, stack_bytes, spill_stores, spill_loads}}} from
    `ptxas -v` output (the lines after each "Compiling entry function" belong to it)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    current: dict[str, int] | None = None
    for line in report.splitlines():
        entry = _PTXAS_ENTRY.search(line)
        if entry:
            current = out.setdefault(entry.group(1), {}).setdefault(entry.group(2), {})
            continue
        if current is None:
            continue
        for key, pattern in _PTXAS_FIELDS.items():
            found = pattern.search(line)
            if found:
                current[key] = int(found.group(1))
    return out


def kernels_with(source: str, pattern: str) -> list[str]:
    """Names of the `__global__` kernels in CUDA `source` whose body matches `pattern`."""
    kernel = r'extern "C" __global__ void (?:__launch_bounds__\([\d, ]+\) )?(\w+)\('
    parts = re.split(kernel, source)
    # parts: [preamble, name1, body1, name2, body2, ...]; a forward declaration of a kernel
    # makes an empty body followed by its definition under the same name.
    names = set()
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if re.search(pattern, body):
            names.add(name)
    return sorted(names)


_FATBIN_MAGIC = 0xBA55ED50


def fatbin_entries(library: Path) -> list[tuple[str, int]]:
    """(kind, sm) of every entry of the fatbin(s) embedded in a built library.

    TVM stores the fatbin inside its own serialized module blob, not in an ELF `.nv_fatbin`
    section, so `cuobjdump model.so` sees nothing; we find the fatbin by its magic number.
    Layout (as nvcc writes it): header {u32 magic, u16 version, u16 header_size, u64 size},
    then entries {u16 kind (1 PTX, 2 ELF/SASS), u16, u32 header_size, u64 payload_size, ...,
    u32 sm at byte 28}.
    """
    import struct

    data = Path(library).read_bytes()
    found, start = [], data.find(struct.pack("<I", _FATBIN_MAGIC))
    while start >= 0:
        _, _, header, size = struct.unpack_from("<IHHQ", data, start)
        off, end = start + header, start + header + size
        while off + 32 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, off)
            (sm,) = struct.unpack_from("<I", data, off + 28)
            found.append(({1: "ptx", 2: "sass"}.get(kind, str(kind)), sm))
            off += entry_header + payload
        start = data.find(struct.pack("<I", _FATBIN_MAGIC), end)
    return found
