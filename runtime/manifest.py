"""The artifact manifest: what was compiled, how, and for what.

The compiler writes it; the runtime reads it and needs nothing else to load the artifact
(the runtime never sees the model's source code).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ArtifactError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.yaml"


@dataclass
class ManifestModel:
    """The manifest's record of the compiled model: what it is and where it came from."""

    name: str
    architecture: str
    source: str  # what the user passed: a folder, a GGUF file or a hub id
    source_kind: str  # "safetensors" or "gguf"
    source_files: dict[str, str]  # file name -> sha256
    config: dict[str, Any]


@dataclass
class KVCacheInfo:
    page_size: int
    dtype: str
    context_window: int
    layout: str = "paged"
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    # Sliding-window attention: the window in positions and the layers it applies to (the
    # attention kernels apply it; every layer keeps its whole history in the cache).
    sliding_window: int | None = None
    windowed_layers: list[int] = field(default_factory=list)


@dataclass
class TargetInfo:
    kind: str  # "cpu", "cuda", "metal"
    tvm_target: dict[str, Any]
    host: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParamInfo:
    name: str
    shape: list[int]
    dtype: str
    shard: str
    quant: str = "none"


@dataclass
class TokenizerInfo:
    files: list[str]
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos_token: bool
    chat_template: str | None  # file name inside the artifact, if the model has one
    bos_token: str | None = None
    eos_token: str | None = None


POOLINGS = ("mean", "last")


@dataclass
class EmbeddingInfo:
    """How the artifact's hidden states become one embedding per input.

    `function` returns the final hidden states of a prefill; the runtime pools them (`mean`
    over the input's tokens, or the `last` token's), then L2-normalises when `normalize`.
    `pooling_source` says where the pooling came from (`1_Pooling/config.json`, the model's
    name, `--pooling`, or `default`).
    """

    function: str
    pooling: str  # one of POOLINGS
    dimensions: int  # the full embedding width (the hidden size)
    normalize: bool = True
    pooling_source: str = "default"


@dataclass
class Manifest:
    format_version: int
    tallow_version: str
    tvm_version: str
    model: ManifestModel
    dtype: str
    quantization: str
    kv_cache: KVCacheInfo
    target: TargetInfo
    library: str
    functions: list[str]
    params: list[ParamInfo]
    tokenizer: TokenizerInfo
    # "generate" (logits, decode, sampler, and the hidden-state function) or "embed" (the
    # hidden-state function only). Artifacts from before embeddings have neither field.
    task: str = "generate"
    embedding: EmbeddingInfo | None = None
    # file name -> {size, sha256[, sample_sha256]} (see `integrity`); None: an artifact from
    # before checksums were recorded
    checksums: dict[str, dict[str, Any]] | None = None

    def to_yaml(self) -> str:
        return yaml.safe_dump(dataclasses.asdict(self), sort_keys=False, allow_unicode=True)

    def write(self, folder: Path) -> None:
        (folder / MANIFEST_NAME).write_text(self.to_yaml(), encoding="utf-8")

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = Path(folder) / MANIFEST_NAME
        if not Path(folder).is_dir():
            raise ArtifactError(f"artifact folder not found: {folder}")
        if not path.is_file():
            raise ArtifactError(f"{folder} is not a tallow artifact (no {MANIFEST_NAME})")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ArtifactError(f"{path}: not valid YAML ({e})") from e
        if not isinstance(raw, dict):
            raise ArtifactError(f"{path}: not a manifest")
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise ArtifactError(
                f"{path}: artifact format version {version!r} is not supported by this tallow "
                f"(it reads version {FORMAT_VERSION}); recompile the model with this tallow"
            )
        try:
            return cls(
                format_version=version,
                tallow_version=raw["tallow_version"],
                tvm_version=raw["tvm_version"],
                model=ManifestModel(**raw["model"]),
                dtype=raw["dtype"],
                quantization=raw["quantization"],
                kv_cache=KVCacheInfo(**raw["kv_cache"]),
                target=TargetInfo(**raw["target"]),
                library=raw["library"],
                functions=list(raw["functions"]),
                params=[ParamInfo(**p) for p in raw["params"]],
                tokenizer=TokenizerInfo(**raw["tokenizer"]),
                task=raw.get("task", "generate"),
                embedding=EmbeddingInfo(**raw["embedding"]) if raw.get("embedding") else None,
                checksums=_checksums(path, raw.get("checksums")),
            )
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"{path}: manifest is missing or has a bad field ({e})") from e


def _checksums(path: Path, raw: Any) -> dict[str, dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ArtifactError(f"{path}: checksums must map file names to {{size, sha256}}")
    return raw
