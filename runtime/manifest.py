"""The artifact manifest: what was compiled, how, and for what.

The compiler writes it; the runtime reads it and needs nothing else to load the artifact
(the runtime never sees the model's source code).

Format 2 holds several compiled libraries (`libraries`, one per target, under `lib/`) that
share the weights; `runtime/library_select.py` picks the one a machine runs. A format-1
manifest (one `target` and one `library`) is read as a one-library artifact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .cpu_features import host_platform
from .errors import ArtifactError
from .sampling_defaults import FALLBACK, SamplingDefaults, SamplingDefaultsError

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: one library, migrated on read (`_from_v1`)
MAIN_WEIGHTS = "main"  # the weight set in `params`
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


# bytes per element of the dtypes an artifact stores (TVM's names)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class KVCacheInfo:
    """The paged KV cache's layout, fixed at compile time (`--kv-dtype`, `--page-size`)."""

    page_size: int  # tokens per page
    dtype: str  # of the cached keys and values (TVM's name), the compute dtype by default
    context_window: int
    layout: str = "paged"
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    # Sliding-window attention: the window in positions and the layers it applies to (the
    # attention kernels apply it; every layer keeps its whole history in the cache).
    sliding_window: int | None = None
    windowed_layers: list[int] = field(default_factory=list)

    def bytes_per_token(self) -> int:
        """Cache memory one token takes: a key and a value per layer and KV head."""
        if self.dtype not in DTYPE_BYTES:
            raise ArtifactError(f"KV cache dtype {self.dtype!r} is not one this runtime knows")
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def bytes_per_page(self) -> int:
        return self.page_size * self.bytes_per_token()


@dataclass
class TargetInfo:
    """Format 1's single target (read only, to migrate old artifacts)."""

    kind: str  # "cpu", "cuda", "metal"
    tvm_target: dict[str, Any]
    host: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class LibraryInfo:
    """One compiled library of the artifact and what a machine needs to run it.

    `platform` is the host code's OS and machine (`linux-x86_64`, `macos-arm64`, as
    `cpu_features.host_platform()` names the running one). A CPU library lists the CPU
    features its code uses (`cpu_features`, /proc/cpuinfo names); a CUDA library the SM
    architectures it holds SASS for (`cuda_archs`). `weights` names the weight set it takes
    (`main`: the manifest's `params`; others: `Manifest.weight_sets`).
    """

    file: str  # path inside the artifact, e.g. lib/cpu-x86-64-v3.so
    device: str  # the runtime's device kind: "cpu", "cuda", "metal"
    target: str  # what it runs on, in words: "cpu x86-64-v3", "cuda sm_80 sm_90", "metal"
    platform: str  # host OS and machine of the library's host code, e.g. "linux-x86_64"
    tvm_target: dict[str, Any]
    host: dict[str, Any] | None = None
    cpu_level: str | None = None  # CPU: --cpu level (native, x86-64-v3, ...)
    cpu_features: list[str] = field(default_factory=list)  # CPU: required features
    cuda_archs: list[str] = field(default_factory=list)  # CUDA: SASS archs, e.g. sm_80
    weights: str = MAIN_WEIGHTS
    details: dict[str, Any] = field(default_factory=dict)  # the compile's BuildReport


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
class TensorParallelInfo:
    """An artifact compiled for `degree` workers (`tallow compile --tensor-parallel`): its
    library is one worker's share of the layers; the weights are stored whole and `shards`
    says how each split one is cut (name -> {axis, parts}: each part of `axis` split in
    `degree` equal slices, worker i taking slice i of each; docs/tensor-parallel.md)."""

    degree: int
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Manifest:
    format_version: int
    tallow_version: str
    tvm_version: str
    model: ManifestModel
    dtype: str
    quantization: str
    kv_cache: KVCacheInfo
    libraries: list[LibraryInfo]
    functions: list[str]
    params: list[ParamInfo]  # the `main` weight set
    tokenizer: TokenizerInfo
    # "generate" (logits, decode, sampler, and the hidden-state function) or "embed" (the
    # hidden-state function only). Artifacts from before embeddings have neither field.
    task: str = "generate"
    embedding: EmbeddingInfo | None = None
    # file name -> {size, sha256[, sample_sha256]} (see `integrity`); None: an artifact from
    # before checksums were recorded
    checksums: dict[str, dict[str, Any]] | None = None
    # Weight sets besides `main` (for a target that needs another layout): name -> params.
    weight_sets: dict[str, list[ParamInfo]] = field(default_factory=dict)
    # Why `dtype`: "--dtype" ("--quant" for `--quant f16`), or the targets' natural dtype
    # ("natural for cuda (model torch_dtype bf16)"); artifacts from before say "--dtype".
    dtype_source: str = "--dtype"
    # The model's sampling defaults (`sampling_defaults.py`): its generation_config.json or
    # GGUF general.sampling keys, else tallow's fallback. Artifacts from before read as the
    # fallback: their source's file was not kept.
    sampling_defaults: SamplingDefaults = FALLBACK
    # None: one worker (artifacts from before tensor parallelism too)
    tensor_parallel: TensorParallelInfo | None = None

    @property
    def tensor_parallel_degree(self) -> int:
        return self.tensor_parallel.degree if self.tensor_parallel else 1

    def params_for(self, library: LibraryInfo) -> list[ParamInfo]:
        """The parameters `library` takes, in its order."""
        if library.weights == MAIN_WEIGHTS:
            return self.params
        try:
            return self.weight_sets[library.weights]
        except KeyError:
            raise ArtifactError(
                f"{library.file} takes weight set {library.weights!r}, which the manifest "
                "does not list"
            ) from None

    def library(self, file: str) -> LibraryInfo:
        for lib in self.libraries:
            if lib.file == file:
                return lib
        raise ArtifactError(f"the artifact has no library {file}")

    def to_yaml(self) -> str:
        return yaml.safe_dump(dataclasses.asdict(self), sort_keys=False, allow_unicode=True)

    def write(self, folder: Path) -> None:
        (folder / MANIFEST_NAME).write_text(self.to_yaml(), encoding="utf-8")

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = Path(folder) / MANIFEST_NAME
        if Path(folder).is_file():
            raise ArtifactError(
                f"{folder} is a file, not an artifact folder (the folder `tallow compile` "
                f"writes, holding {MANIFEST_NAME})"
            )
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
        if version not in READABLE_VERSIONS:
            readable = ", ".join(map(str, READABLE_VERSIONS))
            raise ArtifactError(
                f"{path}: artifact format version {version!r} is not supported by this tallow "
                f"(it reads versions {readable}); recompile the model with this tallow"
            )
        try:
            if version == 1:
                raw = _from_v1(raw)
            return cls(
                format_version=FORMAT_VERSION,
                tallow_version=raw["tallow_version"],
                tvm_version=raw["tvm_version"],
                model=ManifestModel(**raw["model"]),
                dtype=raw["dtype"],
                quantization=raw["quantization"],
                kv_cache=KVCacheInfo(**raw["kv_cache"]),
                libraries=[LibraryInfo(**lib) for lib in raw["libraries"]],
                functions=list(raw["functions"]),
                params=[ParamInfo(**p) for p in raw["params"]],
                tokenizer=TokenizerInfo(**raw["tokenizer"]),
                task=raw.get("task", "generate"),
                embedding=EmbeddingInfo(**raw["embedding"]) if raw.get("embedding") else None,
                checksums=_checksums(path, raw.get("checksums")),
                weight_sets={
                    name: [ParamInfo(**p) for p in params]
                    for name, params in (raw.get("weight_sets") or {}).items()
                },
                dtype_source=raw.get("dtype_source", "--dtype"),
                sampling_defaults=_sampling_defaults(path, raw.get("sampling_defaults")),
                tensor_parallel=(
                    TensorParallelInfo(**raw["tensor_parallel"])
                    if raw.get("tensor_parallel")
                    else None
                ),
            )
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"{path}: manifest is missing or has a bad field ({e})") from e


def _sampling_defaults(path: Path, raw: Any) -> SamplingDefaults:
    if raw is None:
        return FALLBACK
    if not isinstance(raw, dict):
        raise ArtifactError(f"{path}: sampling_defaults must be a mapping of sampling fields")
    try:
        return SamplingDefaults.from_dict(raw)
    except SamplingDefaultsError as e:
        raise ArtifactError(f"{path}: {e}") from e


def _checksums(path: Path, raw: Any) -> dict[str, dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ArtifactError(f"{path}: checksums must map file names to {{size, sha256}}")
    return raw


def _from_v1(raw: dict) -> dict:
    """A format-1 manifest (one `target`, one `library`) as format 2: one library entry.

    Format 1 recorded no required CPU features: its CPU library (built for the compiling
    machine's CPU, `--cpu native`) loads without the feature check, as before.
    """
    target = TargetInfo(**raw["target"])
    details = dict(target.details or {})
    lib = LibraryInfo(
        file=raw["library"],
        device=target.kind,
        target=" ".join([target.kind, *(details.get("archs") or [])]),
        # Unrecorded: assume the machine reading it, as format 1 loaded without checks.
        platform="macos-arm64" if target.kind == "metal" else host_platform(),
        tvm_target=target.tvm_target,
        host=target.host,
        cpu_level="native" if target.kind == "cpu" else None,
        cuda_archs=list(details.get("archs") or []),
        details=details,
    )
    out = {k: v for k, v in raw.items() if k not in ("target", "library")}
    out["libraries"] = [dataclasses.asdict(lib)]
    return out
