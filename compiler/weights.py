"""Weight conversion: checkpoint tensors → the compiled model's parameters, in its order.

Sources are read lazily (memory-mapped), fused where the module fuses them, cast to the
artifact dtype and written as safetensors shards of bounded size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from tallow.runtime.errors import ModelSourceError
from tallow.runtime.manifest import ParamInfo
from tallow.runtime.safetensors_io import SafetensorsError, SafetensorsFile, save_safetensors

from .progress import Progress
from .quant import get_format, quantize

SHARD_BYTES = 1 << 30
_NUMPY_DTYPES = {
    "float32": np.dtype("float32"),
    "float16": np.dtype("float16"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


@dataclass
class ParamSpec:
    """A parameter the compiled library takes, in order."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class SafetensorsCheckpoint:
    """All tensors of a (possibly sharded) safetensors checkpoint, by name."""

    def __init__(self, files: list[Path]):
        self._where: dict[str, SafetensorsFile] = {}
        for path in files:
            try:
                st = SafetensorsFile(path)
            except SafetensorsError as e:
                raise ModelSourceError(f"corrupt or truncated safetensors file: {e}") from e
            for name in st.names():
                self._where[name] = st

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].info(name).shape

    def get(self, name: str) -> np.ndarray:
        return self._where[name].get(name)

    def source_type(self, name: str) -> str:
        return "float"


def logical_shape(p: ParamSpec, qtype: str) -> tuple[int, ...]:
    """The float shape a parameter stands for (quantized ones are [rows, row_bytes])."""
    if qtype == "none":
        return tuple(p.shape)
    qt = get_format(qtype)
    return (p.shape[0], p.shape[1] // qt.type_size * qt.block_size)


def check_sources_present(weight_map: dict[str, list[str]], available: set[str]) -> None:
    missing = sorted({s for srcs in weight_map.values() for s in srcs} - available)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelSourceError(f"checkpoint lacks {len(missing)} tensor(s): {shown}")


def check_weight_map(
    weight_map: dict[str, list[str]],
    params: list[ParamSpec],
    available: set[str],
    shape_of: Callable[[str], tuple[int, ...]],
    qtype_of: Callable[[str], str] = lambda _: "none",
) -> None:
    """Fail before compiling if a tensor is missing or has the wrong shape."""
    unmapped = [p.name for p in params if p.name not in weight_map]
    if unmapped:
        raise ModelSourceError(f"no source tensor for parameter(s): {', '.join(unmapped[:5])}")
    check_sources_present(weight_map, available)
    for p in params:
        sources = weight_map[p.name]
        shapes = [shape_of(s) for s in sources]
        fused = (sum(s[0] for s in shapes), *shapes[0][1:]) if shapes else ()
        expected = logical_shape(p, qtype_of(p.name))
        if _is_vector_of(shapes, expected):
            continue
        if tuple(fused) != expected:
            raise ModelSourceError(
                f"tensor(s) {', '.join(sources)} have shape {list(fused)}; the config implies "
                f"{list(expected)} for {p.name}"
            )


def _is_vector_of(shapes: list[tuple[int, ...]], expected: tuple[int, ...]) -> bool:
    """One source holding a single row or column where the parameter is the other: a
    [1, n] weight stored as an [n] vector (GGUF's Qwen2-MoE shared-expert gate)."""
    if len(shapes) != 1 or tuple(shapes[0]) == tuple(expected):
        return False
    return [d for d in shapes[0] if d != 1] == [d for d in expected if d != 1]


def _converted(
    params: list[ParamSpec], weight_map: dict[str, list[str]], checkpoint, plan
) -> Iterator[tuple[ParamSpec, np.ndarray]]:
    for p in params:
        qtype = plan.qtype(p.name) if plan else "none"
        if qtype != "none":
            if p.name in plan.reused:  # GGUF blocks copied as they are; rows concatenate
                parts = [checkpoint.raw(s) for s in weight_map[p.name]]
                yield p, np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
            else:
                parts = [np.asarray(checkpoint.get(s), np.float32) for s in weight_map[p.name]]
                yield p, quantize(np.concatenate(parts, axis=0), qtype)
            continue
        parts = [np.asarray(checkpoint.get(s)) for s in weight_map[p.name]]
        target = _NUMPY_DTYPES[p.dtype]
        # Cast through float32: numpy has no direct bf16 <-> f16 path.
        parts = [a if a.dtype == target else a.astype(np.float32).astype(target) for a in parts]
        arr = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        yield p, arr.reshape(p.shape) if _is_vector_of([arr.shape], tuple(p.shape)) else arr


def write_weight_shards(
    out: Path,
    params: list[ParamSpec],
    weight_map: dict[str, list[str]],
    checkpoint,
    progress: Progress,
    plan=None,
    prefix: str = "params",
) -> list[ParamInfo]:
    """Write shards `<prefix>_NNNNN.safetensors`; return the manifest's parameter list."""
    infos: list[ParamInfo] = []
    shard: dict[str, np.ndarray] = {}
    shard_bytes = 0
    index = 0

    def flush() -> None:
        nonlocal shard, shard_bytes, index
        if shard:
            save_safetensors(out / f"{prefix}_{index:05d}.safetensors", shard, {"format": "tallow"})
            shard, shard_bytes, index = {}, 0, index + 1

    for n, (p, arr) in enumerate(_converted(params, weight_map, checkpoint, plan), start=1):
        if tuple(arr.shape) != tuple(p.shape):
            raise ModelSourceError(f"{p.name}: converted to {arr.shape}, expected {p.shape}")
        if shard and shard_bytes + arr.nbytes > SHARD_BYTES:
            flush()
        shard[p.name] = arr
        shard_bytes += arr.nbytes
        quant = plan.qtype(p.name) if plan else "none"
        shard_name = f"{prefix}_{index:05d}.safetensors"
        infos.append(ParamInfo(p.name, list(arr.shape), p.dtype, shard_name, quant))
        progress.counter("weights", n, len(params))
    flush()
    return infos
