"""Makes TVM Disco (`tvm.runtime.disco`) importable from the apache-tvm 0.27 wheel.

Why: the wheel's Disco functions live in `libtvm_runtime_extra.so`, which `import tvm` loads
only after `tvm.runtime.disco` has looked its functions up; the module then is None (and
never loads under `TVM_USE_RUNTIME_LIB=1`). Loading `libtvm_runtime.so` and then
`libtvm_runtime_extra.so` with `RTLD_GLOBAL` before `import tvm` registers them in time.
Only the TVM runtime is touched: no compiler, model definitions or schedules.

Once tvm is imported without Disco the functions cannot be bound any more (re-importing the
package collides with what it registered already), so `disco()` says so in one line: call it
before anything imports tvm (the tensor-parallel runner does, `tp_runner.py`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path

from .errors import TallowError

_LIBRARIES = ("libtvm_runtime.so", "libtvm_runtime_extra.so")  # in this order


class DiscoUnavailableError(TallowError):
    pass


def _tvm_lib_dir() -> Path:
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise DiscoUnavailableError("the TVM runtime is not installed (no `tvm` package)")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def preload() -> None:
    """Load the runtime libraries globally so `import tvm` finds Disco's functions."""
    import tvm_ffi  # noqa: F401  (libtvm_runtime links libtvm_ffi: it must be loaded first)

    folder = _tvm_lib_dir()
    for name in _LIBRARIES:
        path = folder / name
        if not path.is_file():
            raise DiscoUnavailableError(f"TVM Disco needs {path}, which this install lacks")
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def disco(ccl: str | None = None):
    """`tvm.runtime.disco`, loading what it needs first; one clear line when it cannot.

    `ccl="nccl"` also loads tallow's NCCL module (`nccl_module.py`), which registers the
    `runtime.disco.nccl.*` functions `Session.init_ccl("nccl", ...)` and the workers call; when
    it is not built the line says what to run. The CPU path needs no CCL (`cpu_collective.py`).
    """
    tvm = sys.modules.get("tvm")
    if tvm is None:
        preload()
        import tvm
    module = getattr(tvm.runtime, "disco", None)
    if module is None or not hasattr(module, "ThreadedSession"):
        raise DiscoUnavailableError(
            "TVM Disco is not loaded: tvm was imported before tallow could preload "
            "libtvm_runtime_extra.so; start tensor-parallel runs before anything imports tvm"
        )
    if ccl is not None:
        from . import nccl_module

        if ccl != nccl_module.CCL:
            raise DiscoUnavailableError(f"no collective library {ccl!r}: tallow builds only nccl")
        nccl_module.load()
    return module
