"""Artifact integrity: checksums recorded at compile time, checked at load and by `tallow verify`.

The manifest's `checksums` maps every file of the artifact but the manifest itself (weight
shards, tokenizer files, chat template and the compiled libraries) to its size and sha256;
weight shards also get a *sample* hash, the sha256 of a few fixed 1 MiB windows (the whole
file when it is no larger than those windows). A library's bytes differ from build to build,
so its entry describes this artifact's copy, not the compile's input.

At load, the size of every file the load needs is checked (a pulled artifact holds only the
library its machine uses, so the others are not asked for), each shard's sample hash is
recomputed (a few MiB read per shard, whatever its size), and the small files (tokenizer,
template, and the library the load runs) are hashed in full: a truncated file, a changed byte
in the library, a damaged header or damage inside a small model's weights is caught before
anything runs. Damage between the windows of a large shard is found by `tallow verify`, which
hashes every byte, and by a hub pull, which hashes what it downloaded before first use
(`hub_pull`). Artifacts compiled before checksums
existed load without the checks.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ArtifactError

log = logging.getLogger(__name__)

WINDOW = 1 << 20
NUM_WINDOWS = 8
_CHUNK = 1 << 22
MISSING = "missing"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sample_offsets(size: int) -> list[int]:
    """Where the sample windows start: evenly spread, the first at 0, the last at the end."""
    if size <= NUM_WINDOWS * WINDOW:
        return [0]  # one window of the whole file
    step = (size - WINDOW) / (NUM_WINDOWS - 1)
    return [round(i * step) for i in range(NUM_WINDOWS)]


def sample_sha256(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= NUM_WINDOWS * WINDOW:
            return sha256_file(path)
        for off in sample_offsets(size):
            f.seek(off)
            h.update(f.read(WINDOW))
    return h.hexdigest()


@dataclass
class FileChecksum:
    size: int
    sha256: str
    sample_sha256: str | None = None  # weight shards only

    @classmethod
    def parse(cls, name: str, raw: Any) -> FileChecksum:
        try:
            return cls(int(raw["size"]), str(raw["sha256"]), raw.get("sample_sha256"))
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"manifest checksum of {name} is malformed ({e})") from e


def record_checksums(folder: Path, names: Iterable[str], sampled: Iterable[str]) -> dict:
    """The manifest's `checksums` for `names` (files in `folder`); `sampled` also get the
    sample hash checked at load."""
    sampled = set(sampled)
    out: dict[str, dict] = {}
    for name in sorted(set(names)):
        path = folder / name
        entry: dict[str, Any] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        if name in sampled:
            entry["sample_sha256"] = sample_sha256(path)
        out[name] = entry
    return out


def _entries(checksums: dict) -> list[tuple[str, FileChecksum]]:
    return [(name, FileChecksum.parse(name, raw)) for name, raw in sorted(checksums.items())]


def size_problem(path: Path, want: FileChecksum) -> str | None:
    if not path.is_file():
        return MISSING
    size = path.stat().st_size
    if size != want.size:
        return f"size {size} bytes, recorded {want.size}"
    return None


def _selected(checksums: dict, names: Iterable[str] | None) -> list[tuple[str, FileChecksum]]:
    """The entries of `names` (every recorded file when None); a name the manifest does not
    record is an error, since nothing could vouch for its contents."""
    entries = _entries(checksums)
    if names is None:
        return entries
    wanted = set(names)
    unrecorded = sorted(wanted - {name for name, _ in entries})
    if unrecorded:
        raise ArtifactError(
            f"the manifest records no checksum for {', '.join(unrecorded)}; recompile the model"
        )
    return [(name, want) for name, want in entries if name in wanted]


def check_at_load(
    folder: Path,
    checksums: dict | None,
    full: Iterable[str] = (),
    names: Iterable[str] | None = None,
) -> None:
    """Sizes of the files in `names` (every recorded file when None), shards' sample hashes
    and the full hash of the files in `full` (small ones); raises `ArtifactError` naming the
    first damaged or missing file."""
    if checksums is None:
        log.warning("%s: no checksums recorded (compiled by an older tallow); not checked", folder)
        return
    full = set(full)
    for name, want in _selected(checksums, names):
        path = folder / name
        problem = size_problem(path, want)
        sampled = want.sample_sha256 is not None
        if problem is None and sampled and sample_sha256(path) != want.sample_sha256:
            problem = "contents differ from the recorded checksum"
        if problem is None and name in full and sha256_file(path) != want.sha256:
            problem = "contents differ from the recorded checksum"
        if problem is not None:
            state = "is missing" if problem == MISSING else f"is damaged ({problem})"
            raise ArtifactError(
                f"{folder}: {name} {state}; recompile the model or copy the "
                f"artifact again (`tallow verify {folder}` checks every file)"
            )


def verify(
    folder: Path, checksums: dict, names: Iterable[str] | None = None
) -> list[tuple[str, str | None]]:
    """Every file in `names` (every recorded one when None), hashed in full:
    (name, problem or None)."""
    results = []
    for name, want in _selected(checksums, names):
        path = folder / name
        problem = size_problem(path, want)
        if problem is None and sha256_file(path) != want.sha256:
            problem = "sha256 differs from the recorded one"
        results.append((name, problem))
    return results
