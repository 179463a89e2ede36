"""The compute dtype of a compile: `--dtype`, or each target's natural one.

Without `--dtype`, every backend names its natural dtype (`TargetBackend.natural_dtype`): f32
on the CPU, f16 on Metal, and on CUDA the model's own half type (its config's `torch_dtype`:
bf16 or f16; f16 for f32 checkpoints and GGUF files). One artifact holds one weight set, so
several targets share one dtype: the first target's natural dtype that every target accepts
(`--target cuda --target metal` on a bf16 model gives f16, Metal's).
"""

from __future__ import annotations

from dataclasses import dataclass

from tallow.runtime.errors import TargetError

from .backends import DTYPES, get_backend

# config.json spellings of a checkpoint's dtype -> `--dtype` names
_TORCH_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "half": "f16",
    "bfloat16": "bf16",
}


@dataclass(frozen=True)
class ComputeDtype:
    dtype: str  # a DTYPES key
    source: str  # why: "--dtype", or "natural for cuda (model torch_dtype bf16)"


def model_dtype(config: dict) -> str | None:
    """The checkpoint's dtype from config.json (`torch_dtype`, transformers 5: `dtype`)."""
    value = config.get("torch_dtype") or config.get("dtype")
    return _TORCH_DTYPES.get(str(value).removeprefix("torch.")) if value else None


def choose_compute_dtype(
    requested: str | None,
    targets: list[str],
    config: dict,
    source_kind: str,
    requested_by: str = "--dtype",
) -> ComputeDtype:
    """`requested` (by the option `requested_by`) when given, else the targets' natural
    dtype (see above)."""
    if requested is not None:
        return ComputeDtype(requested, requested_by)
    declared = model_dtype(config)  # a GGUF's config (from its metadata) states none
    backends = [get_backend(name) for name in targets or ["cpu"]]
    for backend in backends:
        dtype = backend.natural_dtype(declared)
        if all(_accepts(b, dtype) for b in backends):
            said = f"model torch_dtype {declared}" if declared else f"{source_kind}, no torch_dtype"
            return ComputeDtype(dtype, f"natural for {backend.name} ({said})")
    names = ", ".join(b.name for b in backends)
    raise TargetError(f"the targets {names} share no compute dtype; pass --dtype")


def _accepts(backend, dtype: str) -> bool:
    assert dtype in DTYPES, dtype
    try:
        backend.check_dtype(dtype)
    except TargetError:
        return False
    return True
