"""Artifacts on the Hugging Face Hub: `hf://org/repo[@revision]` wherever a folder is taken.

A pull reads the manifest first, then downloads only the files this machine's load reads (the
weights, the tokenizer, the chat template and the one library it will run), never the other
targets' libraries. Everything goes through `huggingface_hub`, so its cache, `HF_HOME`,
`HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `HF_TOKEN` behave as for any hub download; the folder a
pull returns is the cache's snapshot folder, which the runtime then loads like any artifact.

Before first use, every pulled file is hashed in full against the manifest's sha256 (a changed
file is refused, named). Hashing a large model at each start would cost seconds, so a file
that passed is remembered in tallow's own cache (`$XDG_CACHE_HOME/tallow/verified/`, keyed by
the blob's path, size and mtime); later loads of that file check its size only, like any load.

Runtime-side: the server needs it, and it imports neither TVM nor the compiler.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import ArtifactError
from .integrity import MISSING, FileChecksum, sha256_file, size_problem
from .library_select import files_for
from .manifest import MANIFEST_NAME, LibraryInfo, Manifest

log = logging.getLogger(__name__)

SCHEME = "hf://"


@dataclass(frozen=True)
class HubRef:
    """A model repository on the hub holding an artifact, at a revision (None: main)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{SCHEME}{self.repo_id}" + (f"@{self.revision}" if self.revision else "")

    @property
    def name(self) -> str:
        """The repository's name, the served model's default name."""
        return self.repo_id.split("/", 1)[1]


def is_hub_ref(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith(SCHEME)


def parse_hub_ref(spec: str) -> HubRef:
    """`hf://org/repo[@revision]`, through huggingface_hub's own URI parser."""
    from huggingface_hub import parse_hf_uri
    from huggingface_hub.errors import HfUriError

    try:
        uri = parse_hf_uri(spec)
    except HfUriError as e:
        reason = str(e).strip().rstrip(".")
        raise ArtifactError(f"{reason}; expected hf://org/repo or hf://org/repo@revision") from None
    if uri.type != "model" or uri.path_in_repo:
        raise ArtifactError(
            f"{spec}: an artifact is a whole model repository; expected hf://org/repo or "
            "hf://org/repo@revision (no dataset/space prefix, no path inside the repo)"
        )
    return HubRef(uri.id, uri.revision)


# What a pull fetches: the manifest's file names to download, given the manifest.
FileChooser = Callable[[Manifest], Iterable[str]]


def everything(manifest: Manifest) -> list[str]:
    """Every recorded file (`tallow verify hf://...` checks the whole artifact)."""
    return sorted(manifest.checksums or {})


def library_for_device(manifest: Manifest, device: str | None, **machine) -> LibraryInfo:
    """The library a load on `device` (None or `auto`: this machine's choice) will run: the
    runtime's own choice (`library_select`), made before anything else is downloaded.
    `machine` passes facts about another machine (`is_mac`, `cuda_archs`, ...) to simulate it."""
    from .library_select import choose_library

    return choose_library(manifest, device, **machine).library


def files_for_device(device: str | None, **machine) -> FileChooser:
    """What serving or generating on `device` reads: the weights, the tokenizer, the chat
    template and the one library chosen for this machine."""

    def choose(manifest: Manifest) -> list[str]:
        return files_for(manifest, library_for_device(manifest, device, **machine))

    return choose


def pull_manifest(ref: HubRef) -> Path:
    """The snapshot folder holding the manifest of `ref` (nothing else is downloaded)."""
    from huggingface_hub import hf_hub_download

    path = _hub_call(
        ref, lambda: hf_hub_download(ref.repo_id, MANIFEST_NAME, revision=ref.revision)
    )
    return Path(path).parent


def pull(ref: HubRef, files: FileChooser, check: bool = True) -> Path:
    """Download the manifest, then the files `files` picks from it, check their sizes and
    hashes (unless the caller checks them itself: `tallow verify`), and return the snapshot
    folder (loadable as an artifact)."""
    from huggingface_hub import snapshot_download

    snapshot = pull_manifest(ref)
    manifest = Manifest.read(snapshot)
    if manifest.checksums is None:
        raise ArtifactError(
            f"{ref}: its manifest records no checksums, so a download cannot be checked; "
            "recompile and push it with this tallow"
        )
    names = sorted(set(files(manifest)))
    unrecorded = [n for n in names if n not in manifest.checksums]
    if unrecorded:
        raise ArtifactError(
            f"{ref}: the manifest records no checksum for {', '.join(unrecorded)}; "
            "recompile and push it with this tallow"
        )
    # The snapshot folder is named by its commit: the files come from the manifest's commit
    # even when the branch moves between the two calls.
    commit = snapshot.name
    patterns = [MANIFEST_NAME, *names]
    _hub_call(
        ref,
        lambda: snapshot_download(ref.repo_id, revision=commit, allow_patterns=patterns),
    )
    for name in names if check else ():
        _check_pulled(ref, snapshot, name, FileChecksum.parse(name, manifest.checksums[name]))
    log.info("%s: %d files ready in %s", ref, len(names), snapshot)
    return snapshot


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _hub_call(ref: HubRef, call: Callable[[], str]) -> str:
    """Run one huggingface_hub call; its errors become one line naming the repository."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return call()
    except LocalEntryNotFoundError as e:
        if _offline():
            raise ArtifactError(
                f"{ref} is not in the local Hugging Face cache ({_cache_dir()}) and "
                "HF_HUB_OFFLINE is set; pull it once with network access, or unset HF_HUB_OFFLINE"
            ) from e
        raise ArtifactError(
            f"{ref}: the hub could not be reached and no cached copy was found in "
            f"{_cache_dir()} ({_first_line(e)})"
        ) from e
    except GatedRepoError as e:
        raise ArtifactError(f"{ref}: access is gated; accept its terms and set HF_TOKEN") from e
    except RepositoryNotFoundError as e:
        raise ArtifactError(
            f"{ref}: no such repository, or it is private (set HF_TOKEN to a token that can "
            "read it)"
        ) from e
    except RevisionNotFoundError as e:
        raise ArtifactError(f"{ref}: no revision {ref.revision or 'main'} in the repository") from e
    except RemoteEntryNotFoundError as e:
        raise ArtifactError(f"{ref} is not a tallow artifact (no {MANIFEST_NAME})") from e
    except HfHubHTTPError as e:
        raise ArtifactError(f"{ref}: the hub refused the download ({_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _check_pulled(ref: HubRef, snapshot: Path, name: str, want: FileChecksum) -> None:
    path = snapshot / name
    problem = size_problem(path, want)
    if problem == MISSING:
        why = "HF_HUB_OFFLINE is set" if _offline() else "the download did not bring it"
        raise ArtifactError(
            f"{ref}: {name} is not in the local cache ({why}); pull it with network access"
        )
    if problem is None and not _verified_before(path, want):
        if sha256_file(path) != want.sha256:
            problem = "sha256 differs from the manifest's"
        else:
            _remember_verified(path, want)
    if problem is not None:
        raise ArtifactError(
            f"{ref}: {name} does not match the manifest ({problem}), so it was not used; "
            f"delete the cached copy ({_repo_cache_folder(snapshot)}) and pull again"
        )


def _repo_cache_folder(snapshot: Path) -> Path:
    return snapshot.parent.parent  # models--org--repo/snapshots/<commit>


# Files already hashed after a pull: a small JSON per blob in tallow's cache.


def _marks_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tallow" / "verified"


def _mark_path(blob: Path) -> Path:
    return _marks_dir() / (hashlib.sha256(str(blob).encode()).hexdigest()[:32] + ".json")


def _fingerprint(blob: Path, want: FileChecksum) -> dict:
    st = blob.stat()
    return {
        "blob": str(blob),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": want.sha256,
    }


def _verified_before(path: Path, want: FileChecksum) -> bool:
    blob = path.resolve()
    try:
        mark = json.loads(_mark_path(blob).read_text())
    except (OSError, ValueError):
        return False
    return mark == _fingerprint(blob, want)


def _remember_verified(path: Path, want: FileChecksum) -> None:
    blob = path.resolve()
    mark = _mark_path(blob)
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        tmp = mark.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_fingerprint(blob, want)))
        os.replace(tmp, mark)
    except OSError as e:  # a read-only cache only costs a hash at the next start
        log.debug("cannot record %s as verified (%s)", path, e)
