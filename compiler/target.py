"""Compile targets: what the user names (`cpu`), what TVM needs, and which dtypes run there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tallow.runtime.errors import TargetError

DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


@dataclass
class TargetSpec:
    kind: str  # "cpu" | "cuda" | "metal"
    tvm_target: dict[str, Any]
    host: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def tvm(self):
        import tvm

        if self.host is None:
            return tvm.target.Target(self.tvm_target)
        return tvm.target.Target(self.tvm_target, host=self.host)

    @property
    def suffix(self) -> str:
        return self.kind


def _host_cpu() -> str:
    import tvm

    get = tvm.get_global_func("target.llvm_get_system_cpu", allow_missing=True)
    return str(get()) if get is not None else "generic"


def resolve_target(kind: str, dtype: str) -> TargetSpec:
    if kind != "cpu":
        raise TargetError(f"target {kind!r} is not supported yet; supported: cpu")
    if dtype not in DTYPES:
        raise TargetError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    cpu = _host_cpu()
    return TargetSpec(
        kind="cpu",
        tvm_target={"kind": "llvm", "mcpu": cpu},
        details={"mcpu": cpu},
    )
