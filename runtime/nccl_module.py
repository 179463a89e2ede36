"""tallow's NCCL collective module for TVM Disco: where it comes from, how it is built, loading it.

The apache-tvm 0.27 wheel has Disco but no collective library, so CUDA tensor parallelism needs
`runtime.disco.nccl.*` from somewhere. `native/disco_nccl.cc` (tallow's own C++) registers
them; this module compiles it, once per machine, with the host C++ compiler against:

- TVM's and tvm-ffi's C++ headers and libraries, which the wheels ship (`tvm/include`,
  `tvm_ffi/include`, `libtvm_runtime_extra.so` holds Disco's `DiscoWorker`);
- PyPI's NCCL, `nvidia-nccl-cu13` (`nccl.h`, `libnccl.so.2`), and PyPI's CUDA runtime,
  `nvidia-cuda-runtime` 13 (`cuda_runtime_api.h`, `libcudart.so.13`). CUDA 13 because the
  wheel's `libtvm_runtime_cuda.so` links `libcudart.so.13` (readelf -d): one CUDA runtime per
  process. A CUDA toolkit (`$CUDA_HOME`) stands in when the PyPI runtime is absent.

`pip install 'tallow[cuda]'` brings both wheels, `tallow build-nccl` runs `build()`. The result
goes to `<cache>/nccl/<key>/libtallow_disco_nccl.so`, the key hashing the source, the compile
command and the versions it was built against, so a changed input builds anew and an unchanged
one is never rebuilt. The file is written under a temporary name and renamed into place: a
failed build leaves nothing a later load could pick up. The library carries the folders of the
libraries it links as RUNPATH, so loading it needs no LD_LIBRARY_PATH.

On a GPU it has only been loaded, on one H100 (docs/tensor-parallel.md): no collective has run.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import TallowError

SOURCE = Path(__file__).parent / "native" / "disco_nccl.cc"
# Declarations for two headers the wheel's tvm/runtime/tensor.h includes but does not ship.
SHIM = Path(__file__).parent / "native" / "shim"
LIBRARY = "libtallow_disco_nccl.so"
# Everything Disco may look up for ccl "nccl" (TVM 0.27's builtins and Session.init_ccl).
FUNCTIONS = (
    "init_ccl",
    "init_ccl_per_worker",
    "allreduce",
    "allgather",
    "broadcast_from_worker0",
    "scatter_from_worker0",
    "gather_to_worker0",
    "recv_from_worker0",
    "send_to_next_group",
    "recv_from_prev_group",
    "send_to_worker",
    "recv_from_worker",
    "sync_worker",
)
CCL = "nccl"
PREFIX = f"runtime.disco.{CCL}."
SETUP_HINT = "pip install 'tallow[cuda]' && tallow build-nccl"


class NcclModuleError(TallowError):
    pass


@dataclass(frozen=True)
class Toolchain:
    """What one build compiles and links with."""

    compiler: str
    include_dirs: tuple[Path, ...]
    lib_dirs: tuple[Path, ...]  # also the built library's RUNPATH
    libraries: tuple[str, ...]
    versions: tuple[str, ...]  # what the key hashes besides the source and the command

    def command(self, source: Path, output: Path) -> list[str]:
        return [
            self.compiler,
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-shared",
            "-fvisibility=hidden",
            "-Wall",
            *(f"-I{d}" for d in self.include_dirs),
            str(source),
            "-o",
            str(output),
            *(f"-L{d}" for d in self.lib_dirs),
            *(f"-l:{name}" for name in self.libraries),
            # every symbol must resolve against the libraries named here, at link time
            "-Wl,--no-undefined",
            "-Wl,--enable-new-dtags",
            "-Wl,-rpath," + ":".join(str(d) for d in self.lib_dirs),
        ]


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _version(dist: str) -> str:
    try:
        return f"{dist}=={importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{dist} absent"


def _cuda_runtime() -> tuple[Path, Path]:
    """(include dir, lib dir) of a CUDA 13 runtime: PyPI's wheel first, else a toolkit."""
    nvidia = _package_dir("nvidia")
    candidates = [nvidia / "cu13"] if nvidia else []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]))
    candidates.append(Path("/usr/local/cuda"))
    for root in candidates:
        for lib in (root / "lib", root / "lib64"):
            if (root / "include" / "cuda_runtime_api.h").is_file() and (
                lib / "libcudart.so.13"
            ).is_file():
                return root / "include", lib
    raise NcclModuleError(
        "building the NCCL module needs the CUDA 13 runtime (cuda_runtime_api.h, "
        f"libcudart.so.13): {SETUP_HINT}"
    )


def toolchain() -> Toolchain:
    """Find the compiler, headers and libraries; one line naming what is missing."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if not compiler:
        raise NcclModuleError("building the NCCL module needs a C++ compiler (g++ or clang++)")
    tvm, tvm_ffi, nvidia = _package_dir("tvm"), _package_dir("tvm_ffi"), _package_dir("nvidia")
    if tvm is None or tvm_ffi is None:
        raise NcclModuleError("building the NCCL module needs the apache-tvm wheel")
    nccl = nvidia / "nccl" if nvidia else None
    if nccl is None or not (nccl / "include" / "nccl.h").is_file():
        raise NcclModuleError(f"building the NCCL module needs PyPI's NCCL: {SETUP_HINT}")
    cuda_include, cuda_lib = _cuda_runtime()
    return Toolchain(
        compiler=compiler,
        include_dirs=(SHIM, tvm / "include", tvm_ffi / "include", nccl / "include", cuda_include),
        lib_dirs=(tvm / "lib", tvm_ffi / "lib", nccl / "lib", cuda_lib),
        libraries=(
            "libtvm_runtime_extra.so",
            "libtvm_runtime.so",
            "libtvm_ffi.so",
            "libnccl.so.2",
            "libcudart.so.13",
        ),
        versions=(
            _version("apache-tvm"),
            _version("apache-tvm-ffi"),
            _version("nvidia-nccl-cu13"),
            _version("nvidia-cuda-runtime"),
            _version("nvidia-cuda-crt"),
            _version("nvidia-cuda-cccl"),
        ),
    )


def cache_root() -> Path:
    """$TALLOW_CACHE_DIR, else $XDG_CACHE_HOME/tallow, else ~/.cache/tallow (as `tallow serve`)."""
    if os.environ.get("TALLOW_CACHE_DIR"):
        return Path(os.environ["TALLOW_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tallow"


def library_path(tools: Toolchain) -> Path:
    """Where `tools` builds the module: keyed by the source, the command and the versions."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    for header in sorted(SHIM.rglob("*.h")):
        digest.update(header.read_bytes())
    for part in (*tools.command(Path("SRC"), Path("OUT")), *tools.versions):
        digest.update(b"\0" + part.encode())
    return cache_root() / "nccl" / digest.hexdigest()[:16] / LIBRARY


def build(force: bool = False) -> Path:
    """Compile the module unless it is built already; its path."""
    tools = toolchain()
    out = library_path(tools)
    if out.is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        partial = Path(tmp) / LIBRARY
        proc = subprocess.run(tools.command(SOURCE, partial), capture_output=True, text=True)
        if proc.returncode != 0:
            detail = proc.stderr.strip()[-4000:]
            raise NcclModuleError(
                f"compiling {SOURCE.name} with {tools.compiler} failed (exit {proc.returncode})"
                + (f":\n{detail}" if detail else "")
            )
        os.replace(partial, out)
    return out


def built() -> Path | None:
    """The built module for this install, or None (never builds)."""
    try:
        path = library_path(toolchain())
    except NcclModuleError:
        return None
    return path if path.is_file() else None


_loaded: Path | None = None


def load(path: Path | None = None) -> Path:
    """Load the module into this process (TVM's runtime libraries must be loaded already:
    `disco_runtime.preload`); it registers `runtime.disco.nccl.*`. Idempotent."""
    global _loaded
    if _loaded is not None:
        return _loaded
    path = path or built()
    if path is None:
        raise NcclModuleError(
            f"CUDA tensor parallelism needs tallow's NCCL module, which is not built: {SETUP_HINT}"
        )
    _load_cuda_device_api()
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise NcclModuleError(f"cannot load the NCCL module {path}: {e}") from e
    _loaded = path
    return path


def _load_cuda_device_api() -> None:
    """TVM's CUDA device API, through which Disco allocates the workers' tensors: runtime-only
    TVM keeps it in `libtvm_runtime_cuda.so`, which the one-GPU runner loads (devices.py) and
    Disco does not. Without it the first worker allocation aborted the process (an H100,
    2026-12-06). On a machine without a driver it cannot load; `init_ccl` then says so."""
    import tvm

    from .devices import device_kind
    from .errors import ArtifactError

    with contextlib.suppress(ArtifactError):
        device_kind("cuda").load_driver(tvm, "NCCL tensor parallelism")
