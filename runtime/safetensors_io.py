"""Reading safetensors files with memory mapping, bfloat16 and float8 included.

The `safetensors` package's numpy reader rejects bfloat16, the usual dtype of released
checkpoints, so we parse the (simple, documented) format ourselves: an 8-byte little-endian
header length, a JSON header of {name: {dtype, shape, data_offsets}}, then the raw data.
Every offset is checked against the file size, so a truncated file fails with its name.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .errors import TallowError

_DTYPES = {
    "F64": np.dtype("float64"),
    "F32": np.dtype("float32"),
    "F16": np.dtype("float16"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("int64"),
    "I32": np.dtype("int32"),
    "I16": np.dtype("int16"),
    "I8": np.dtype("int8"),
    "U8": np.dtype("uint8"),
    "U16": np.dtype("uint16"),
    "U32": np.dtype("uint32"),
    "BOOL": np.dtype("bool"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsError(TallowError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsFile:
    """A lazily read safetensors file: `names()`, `info(name)`, `get(name)`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{self.path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                raise SafetensorsError(f"{self.path}: header length {n} exceeds the file")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SafetensorsError(f"{self.path}: corrupt safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: corrupt safetensors header")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._infos: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            try:
                dtype = _DTYPES[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                start, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise SafetensorsError(f"{self.path}: bad entry for tensor {name!r}") from e
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - start != expected or start < 0:
                raise SafetensorsError(f"{self.path}: tensor {name!r} has inconsistent offsets")
            if self._data_start + end > size:
                raise SafetensorsError(
                    f"{self.path}: truncated (tensor {name!r} ends at byte "
                    f"{self._data_start + end}, the file has {size})"
                )
            self._infos[name] = TensorInfo(dtype, shape, start, end)
        self._mmap: np.memmap | None = None

    def names(self) -> list[str]:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only array backed by the mapped file."""
        info = self._infos[name]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mmap[self._data_start + info.start : self._data_start + info.end]
        return raw.view(info.dtype).reshape(info.shape)


def save_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write tensors in the given order with a canonical header, so the bytes are reproducible."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, arr in tensors.items():
        nbytes = arr.nbytes
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
