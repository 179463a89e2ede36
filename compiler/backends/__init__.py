"""Compile targets as backend objects, one module per target, found by name in `BACKENDS`.

`cpu` (LLVM, for a `--cpu` level or the build machine's CPU), `cuda` (SASS for one or more SM
architectures, built without a driver) and `metal` (Apple GPUs; host objects linked on the
Mac). `rocm` and `vulkan` have no backend yet: each would be one more module here, likely a
`GPUBackend` subclass (`gpu.py`) with its own build step, registered below.
"""

from __future__ import annotations

from tallow.runtime.errors import TargetError

from .base import DTYPES, BuildReport, TargetBackend, TargetSpec

__all__ = [
    "BACKENDS",
    "DTYPES",
    "BuildReport",
    "TargetBackend",
    "TargetSpec",
    "get_backend",
    "register_backend",
    "resolve_target",
    "unregister_backend",
]

BACKENDS: dict[str, TargetBackend] = {}


def register_backend(backend: TargetBackend) -> TargetBackend:
    """Make `backend` available as `--target <backend.name>`."""
    if backend.name in BACKENDS:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    BACKENDS[backend.name] = backend
    return backend


def unregister_backend(name: str) -> None:
    BACKENDS.pop(name, None)


def get_backend(name: str) -> TargetBackend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise TargetError(
            f"target {name!r} is not supported; supported: {', '.join(BACKENDS)}"
        ) from None


def resolve_target(
    name: str, dtype: str, sms: list[int] | None = None, cpu: str | None = None
) -> TargetSpec:
    """The `TargetSpec` for `--target name --dtype dtype [--sm ...] [--cpu LEVEL]`, or a
    `TargetError`."""
    return get_backend(name).resolve(dtype, sms, cpu)


def _register_builtin() -> None:
    from .cpu import CPUBackend
    from .cuda import CUDABackend
    from .metal import MetalBackend

    for backend in (CPUBackend(), CUDABackend(), MetalBackend()):
        register_backend(backend)


_register_builtin()
