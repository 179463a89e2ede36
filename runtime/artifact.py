"""Loading an artifact folder with the TVM runtime alone.

Nothing here imports `tvm.relax` or the compiler: a deployed machine needs only
`libtvm_runtime` (`TVM_USE_RUNTIME_LIB=1` works).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ArtifactError
from .integrity import check_at_load
from .library_select import files_for
from .manifest import LibraryInfo, Manifest
from .safetensors_io import SafetensorsError, SafetensorsFile

log = logging.getLogger(__name__)


@dataclass
class TokenizerBundle:
    tokenizer: object  # tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos_token: bool
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None


def load_tokenizer(folder: Path, manifest: Manifest) -> TokenizerBundle:
    from tokenizers import Tokenizer

    info = manifest.tokenizer
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ArtifactError(f"{folder}: tokenizer.json is missing")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own types
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ArtifactError(f"{folder}: tokenizer.json is damaged or unreadable ({first})") from e
    template = None
    if info.chat_template:
        try:
            template = (folder / info.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ArtifactError(
                f"{folder}: chat template {info.chat_template} is damaged or unreadable ({e})"
            ) from e
    return TokenizerBundle(
        tokenizer=tokenizer,
        bos_token_id=info.bos_token_id,
        eos_token_ids=list(info.eos_token_ids),
        add_bos_token=info.add_bos_token,
        chat_template=template,
        bos_token=info.bos_token,
        eos_token=info.eos_token,
    )


def tokenizer_files(manifest: Manifest) -> list[str]:
    """The tokenizer files and the chat template (small: hashed in full at load)."""
    info = manifest.tokenizer
    return [*info.files, *([info.chat_template] if info.chat_template else [])]


def check_artifact_files(
    folder: Path, manifest: Manifest, library: LibraryInfo | None = None
) -> None:
    """The files `library` (default: the artifact's only one) needs are present and undamaged.
    Other libraries and the weight sets they alone take are not looked at: a download may
    fetch only the library it runs."""
    if library is None:
        if len(manifest.libraries) != 1:
            raise ArtifactError(f"{folder}: several libraries; say which one to check")
        library = manifest.libraries[0]
    lib = folder / library.file
    if not lib.is_file():
        raise ArtifactError(f"{folder}: compiled library {library.file} is missing")
    params = manifest.params_for(library)
    for shard in sorted({p.shard for p in params}):
        if not (folder / shard).is_file():
            raise ArtifactError(f"{folder}: weight shard {shard} is missing")
    # Sizes of what this load reads, the shards' sample hashes, and the small files in full:
    # tokenizer, template and the library (a few MB: sha256 ran at 0.5 GB/s on a shared
    # 2-core box). Artifacts from before libraries were recorded skip that entry.
    recorded = manifest.checksums or {}
    needed = [name for name in files_for(manifest, library) if name in recorded]
    full = [*tokenizer_files(manifest), library.file]
    check_at_load(folder, manifest.checksums, full=full, names=needed)


def read_weights(folder: Path, manifest: Manifest, library: LibraryInfo) -> list[np.ndarray]:
    """The parameters in the order `library` takes them, as mapped arrays."""
    files: dict[str, SafetensorsFile] = {}
    arrays = []
    for p in manifest.params_for(library):
        try:
            f = files.get(p.shard) or files.setdefault(p.shard, SafetensorsFile(folder / p.shard))
            arr = f.get(p.name)
        except SafetensorsError as e:
            raise ArtifactError(f"damaged artifact weights: {e}") from e
        except KeyError as e:
            raise ArtifactError(f"{folder}: weight {p.name} is missing from {p.shard}") from e
        if list(arr.shape) != list(p.shape):
            raise ArtifactError(f"{folder}: weight {p.name} has shape {arr.shape}, not {p.shape}")
        arrays.append(arr)
    return arrays
