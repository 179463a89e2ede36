"""tallow.runtime: loads artifacts with the TVM runtime alone and serves requests.

`Engine`, `EngineOptions`, `build_engine` and `SamplingParams` are importable from here;
they load lazily so that `import tallow.runtime` stays cheap.
"""

from __future__ import annotations

_EXPORTS = {
    "Engine": "engine",
    "EngineOptions": "engine_factory",
    "build_engine": "engine_factory",
    "SamplingParams": "sampling_params",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(name)
