"""A Hugging Face cache written as huggingface_hub writes it, for offline pull tests.

`<HF_HOME>/hub/models--org--repo/` holds `blobs/<etag>` (the content; an LFS file's etag is
its sha256), `snapshots/<commit>/<path>` (relative symlinks into `blobs/`) and `refs/main`
(the commit of the branch). Offline, huggingface_hub resolves `main` through `refs/main` and
serves files from the snapshot folder.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def repo_folder(hf_home: Path, repo_id: str) -> Path:
    return hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))


def write_cached_repo(
    hf_home: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT
) -> Path:
    """Cache `files` (repository path -> bytes) as revision main of `repo_id`; returns the
    snapshot folder."""
    storage = repo_folder(hf_home, repo_id)
    snapshot = storage / "snapshots" / commit
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def artifact_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
