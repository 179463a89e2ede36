"""Finding and checking the model to compile: a local folder, a GGUF file, or a hub id.

Everything is validated here, before any compile work starts, so a bad model folder
fails with a message naming the problem and nothing half-written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tallow.runtime.errors import ModelSourceError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass
class ModelSource:
    """A model ready to read: where it came from and which files hold what."""

    spec: str  # what the user passed
    kind: str  # "safetensors" or "gguf"
    folder: Path
    config: dict
    weight_files: list[Path]
    tokenizer_files: list[Path] = field(default_factory=list)
    gguf_file: Path | None = None
    hub_id: str | None = None
    # Sampling defaults known for this exact model when its files carry none (the embedded
    # default model's card); None: read them from the files (`tokenizer_files`).
    known_sampling: Any = None

    @property
    def name(self) -> str:
        return slug(self.hub_id.split("/")[-1] if self.hub_id else self.folder.name)

    def input_files(self) -> list[Path]:
        return sorted({*self.weight_files, *self.tokenizer_files, self.folder / "config.json"})

    @property
    def file_type(self) -> str | None:
        """The quantization the files declare as a whole (a GGUF's `general.file_type`,
        `q4_k_m`), named in the artifact when their types are kept; None: not declared."""
        return None

    def open_checkpoint(self):
        """The source tensors by name (`names()`, `shape(name)`, `get(name)`)."""
        from .weights import SafetensorsCheckpoint

        return SafetensorsCheckpoint(self.weight_files)

    def weight_map(self, architecture, config) -> dict[str, list[str]]:
        return architecture.hf_weight_map(config)


def slug(base: str) -> str:
    """A model name fit for an artifact folder name."""
    return re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-") or "model"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _looks_like_hub_id(spec: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec)) and not spec.startswith(".")


def _download_from_hub(repo_id: str) -> Path:
    """The snapshot folder of a hub model, from the local cache or a download.

    huggingface_hub honours HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE itself.
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - a hard dependency
        raise ModelSourceError(f"huggingface_hub is needed for hub ids ({e})") from e
    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ModelSourceError(
            f"{repo_id} is not in the local Hugging Face cache and {why}; "
            f"download it first or pass a local folder"
        ) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelSourceError(f"cannot fetch {repo_id} from the Hugging Face hub: {e}") from e


def resolve_source(spec: str, gguf_file: str | None = None) -> ModelSource:
    """The model `--model SPEC [--file NAME.gguf]` names, opened (downloaded for a hub id)."""
    source = _resolve(spec, gguf_file, probe=False)
    assert source is not None
    return source


def check_source(spec: str, gguf_file: str | None = None) -> None:
    """Refuse what `resolve_source` would refuse, as far as that needs neither TVM nor the
    network (the model definitions import TVM, about 4-10 s): a missing path, a text file, a
    pickle, a folder without config.json, safetensors or tokenizer, an unreadable or
    incomplete GGUF set. A hub id is only checked for its form. `tallow compile` runs this
    first, so a typo is reported at once."""
    _resolve(spec, gguf_file, probe=True)


def _resolve(spec: str, gguf_file: str | None, probe: bool) -> ModelSource | None:
    """`resolve_source`'s decisions; `probe`: check without TVM or the network, open nothing
    (returns None for a GGUF or a hub id)."""
    if spec == "default":
        from .default_model import MODEL_CARD_SAMPLING, default_model_path

        source = _resolve(str(default_model_path(check_hash=not probe)), None, probe)
        if source is not None:
            source.known_sampling = MODEL_CARD_SAMPLING
        return source
    path = Path(spec).expanduser()
    if gguf_file is not None:
        return _named_gguf(spec, path, gguf_file, probe)
    if path.is_file():
        if path.suffix == ".gguf":
            return _open_gguf(spec, path, probe)
        if path.suffix in PICKLE_SUFFIXES:
            raise _pickle_error(path)
        raise ModelSourceError(
            f"{path}: a file that is not a .gguf; --model takes a model folder (config.json, "
            "safetensors, tokenizer.json), a .gguf file, a hub id (org/name) or 'default'"
        )
    if not path.exists():
        if _looks_like_hub_id(spec) and not spec.startswith(("/", "~")):
            if probe:
                return None
            source = _folder_source(spec, _download_from_hub(spec), probe)
            source.hub_id = spec
            return source
        if _looks_like_bare_name(spec):
            return _resolve(_cached_repo_for(spec), gguf_file, probe)
        raise ModelSourceError(f"model not found: {spec} (no such folder or file)")
    return _folder_source(spec, path, probe)


def _open_gguf(spec: str, path: Path, probe: bool):
    from .gguf_source import check_gguf_file, gguf_source

    if probe:
        check_gguf_file(path)
        return None
    return gguf_source(spec, path)


def _looks_like_bare_name(spec: str) -> bool:
    """`Qwen3-8B`: a hub repository's name without its organisation."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*", spec))


def _cached_repo_for(name: str) -> str:
    """The one `org/name` model repository in the local Hugging Face cache whose name is
    `name` (case-insensitive). A bare name never triggers a download: which organisation
    the user meant is a guess we do not make."""
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE)
    found = sorted(
        d.name.removeprefix("models--").replace("--", "/", 1)
        for d in (cache.glob("models--*--*") if cache.is_dir() else [])
        if d.name.split("--", 2)[-1].lower() == name.lower()
    )
    if len(found) == 1:
        return found[0]
    if found:
        raise ModelSourceError(
            f"model not found: {name}; the Hugging Face cache has several: {', '.join(found)} "
            f"(pass one of them)"
        )
    raise ModelSourceError(
        f"model not found: {name} is no folder or file, and no repository of that name is in "
        f"the local Hugging Face cache ({cache}); name the hub repository as org/name (did you "
        f"mean {_guess_org(name)}/{name}?)"
    )


# Organisations of the model families tallow compiles, to word the hint of a bare name.
_KNOWN_ORGS = {
    "qwen": "Qwen",
    "llama": "meta-llama",
    "smollm": "HuggingFaceTB",
    "mistral": "mistralai",
}


def _guess_org(name: str) -> str:
    low = name.lower()
    return next((org for prefix, org in _KNOWN_ORGS.items() if low.startswith(prefix)), "ORG")


def _named_gguf(spec: str, path: Path, gguf_file: str, probe: bool) -> ModelSource | None:
    """`--model FOLDER_OR_HUB_ID --file NAME.gguf`."""
    if path.is_dir():
        target = path / gguf_file
        if not target.is_file():
            raise ModelSourceError(f"{target}: no such GGUF file")
        return _open_gguf(spec, target, probe)
    if not _looks_like_hub_id(spec):
        raise ModelSourceError(f"--file needs a folder or a hub id; {spec} is neither")
    if probe:
        return None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        local = Path(hf_hub_download(spec, gguf_file))
    except LocalEntryNotFoundError as e:
        raise ModelSourceError(
            f"{spec}/{gguf_file} is not in the local Hugging Face cache and cannot be downloaded"
        ) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelSourceError(f"cannot fetch {spec}/{gguf_file}: {e}") from e
    return _open_gguf(spec, local, probe)


def _pickle_error(path: Path) -> ModelSourceError:
    return ModelSourceError(
        f"{path}: PyTorch pickle checkpoints are refused, because loading a pickle can run "
        f"arbitrary code; convert the model to safetensors (or GGUF) first"
    )


def _folder_source(spec: str, folder: Path, probe: bool = False) -> ModelSource | None:
    ggufs = sorted(folder.glob("*.gguf"))
    config_path = folder / "config.json"
    if ggufs and not config_path.is_file():
        from .gguf_source import SPLIT_RE

        models = sorted({SPLIT_RE.sub(r"\g<stem>", p.name) for p in ggufs})
        if len(models) > 1:
            raise ModelSourceError(
                f"{folder} holds several GGUF models ({', '.join(models)}); choose one with --file"
            )
        return _open_gguf(spec, ggufs[0], probe)
    if not config_path.is_file():
        raise ModelSourceError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelSourceError(f"{config_path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ModelSourceError(f"{config_path}: expected a JSON object")
    weights = _safetensors_files(folder)
    tokenizer_files = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
    if not (folder / "tokenizer.json").is_file():
        raise ModelSourceError(
            f"{folder}: no tokenizer.json (the fast-tokenizer file is needed at run time)"
        )
    try:
        from tokenizers import Tokenizer

        Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise ModelSourceError(f"{folder / 'tokenizer.json'}: cannot be read ({e})") from e
    return ModelSource(spec, "safetensors", folder, config, weights, tokenizer_files)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelSourceError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelSourceError(f"{folder}: shards named in the index are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise _pickle_error(pickles[0])
    raise ModelSourceError(f"{folder}: no *.safetensors weights found")
