"""GGUF files as a model source: metadata → config, tensors → parameters, tokenizer.

A GGUF model is one file or a split set (`name-00001-of-00003.gguf` …). Everything is
checked when the source is opened (architecture, tensor types, missing shards), so a bad
file fails before any compile work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tallow.model_defs.config import ROPE_FREQ_FACTORS_KEY
from tallow.runtime.errors import ModelSourceError
from tallow.runtime.manifest import TokenizerInfo
from tallow.runtime.sampling_defaults import SamplingDefaults, from_gguf

from .source import ModelSource, slug
from .tokenizer_files import CHAT_TEMPLATE_FILE

if TYPE_CHECKING:
    from tallow.model_defs.registry import Architecture

QUANT_SUFFIX_RE = re.compile(r"[.-](i?q\d\w*|f16|f32|bf16)$", re.IGNORECASE)
SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _gguf():
    import gguf

    return gguf


def supported_types() -> set:
    """The GGML tensor types tallow reads: the floats and every registered block format's."""
    from .quant import QUANT_FORMATS

    q = _gguf().GGMLQuantizationType
    blocks = {f.ggml_type for f in QUANT_FORMATS.values() if f.ggml_type is not None}
    return {q.F32, q.F16, q.BF16, *blocks}


def split_files(path: Path) -> list[Path]:
    """All shards of a split GGUF set (in order), or just `path`."""
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    files = [path.parent / f"{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelSourceError(f"split GGUF set {m['stem']} is incomplete: missing {missing}")
    return files


# GGML types llama.cpp writes that the pinned `gguf` reader does not know (it stops at them)
_NEWER_TYPES = {42: "Q2_0"}
_UNKNOWN_TYPE = re.compile(r"(\d+)\)? is not a valid GGMLQuantizationType")


def _open_reader(path: Path):
    try:
        return _gguf().GGUFReader(path)
    except ValueError as e:
        m = _UNKNOWN_TYPE.search(str(e))
        if m is None:
            raise ModelSourceError(
                f"{path}: not a readable GGUF file (truncated or corrupt: {e})"
            ) from e
        number = int(m[1])
        raise ModelSourceError(
            f"{path}: a tensor is stored as GGML type {number}"
            f"{f' ({_NEWER_TYPES[number]})' if number in _NEWER_TYPES else ''}, which the "
            f"gguf package {_gguf_version()} cannot read, so tallow cannot either; requantize "
            f"the file to another type (llama.cpp's llama-quantize --allow-requantize)"
        ) from e
    except Exception as e:  # the gguf reader raises ValueError/IndexError/struct errors
        raise ModelSourceError(
            f"{path}: not a readable GGUF file (truncated or corrupt: {e})"
        ) from e


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


class GGUFCheckpoint:
    """Tensors of a GGUF set by name, dequantized to float32 on read."""

    def __init__(self, readers: list, arch: Architecture, n_head: int, n_head_kv: int):
        self._tensors = {t.name: t for r in readers for t in r.tensors}
        self._permute = arch.gguf_permute_qk
        self._heads = {"attn_q": n_head, "attn_k": n_head_kv}

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dimensions fastest-first; numpy (and HF) order is the reverse. Stacked
        # tensors (MoE experts, [experts, rows, cols]) read as one [experts * rows, cols]
        # matrix: rows of blocks, as their parameters are declared (model_defs/moe.py).
        shape = tuple(int(d) for d in reversed(self._tensors[name].shape))
        if len(shape) > 2:
            rows = 1
            for d in shape[:-1]:
                rows *= d
            return (rows, shape[-1])
        return shape

    def source_type(self, name: str) -> str:
        """Our block-type name of a tensor ("q4_1", "q4k", ...), or "float"."""
        from .quant import format_for_ggml_type

        fmt = format_for_ggml_type(self._tensors[name].tensor_type)
        return "float" if fmt is None else fmt.name

    def raw(self, name: str) -> np.ndarray:
        """The tensor's GGUF blocks as uint8 [rows, row_bytes], rows in HF order."""
        t = self._tensors[name]
        rows = self.shape(name)[0]
        return self._hf_row_order(name, np.asarray(t.data).view(np.uint8).reshape(rows, -1))

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32: floats as stored, block types through tallow's own decoders
        (bit-exact with `gguf`'s where it has one; it has none for some types, Q1_0)."""
        from .quant import dequantize, format_for_ggml_type

        t = self._tensors[name]
        fmt = format_for_ggml_type(t.tensor_type)
        if fmt is None:
            arr = _gguf().quants.dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        else:
            arr = dequantize(np.asarray(t.data).view(np.uint8), fmt.name, self.shape(name))
        return self._hf_row_order(name, arr)

    def _hf_row_order(self, name: str, arr: np.ndarray) -> np.ndarray:
        """Rows of a llama q/k weight (float or blocks alike) back in HF's order."""
        kind = name.split(".")[-2] if name.count(".") >= 2 else ""
        if self._permute and kind in self._heads and name.endswith(".weight"):
            return unpermute_rows(arr, self._heads[kind])
        return arr


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for the llama architecture.

    HF checkpoints rotate pairs (i, i + d/2) of each head; llama.cpp's converter interleaves
    them as (2i, 2i + 1) for its rope kernel. Our cache uses HF's rotate-half convention.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GGUFModelSource(ModelSource):
    files: list[Path] = field(default_factory=list)
    architecture: Architecture | None = None
    readers: list = field(default_factory=list)

    @property
    def name(self) -> str:
        stem = self.files[0].name
        m = SPLIT_RE.match(stem)
        base = m["stem"] if m else self.files[0].stem
        # "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct": the format is named apart
        return slug(QUANT_SUFFIX_RE.sub("", base) or base)

    def input_files(self) -> list[Path]:
        return list(self.files)

    @property
    def file_type(self) -> str | None:
        """`general.file_type` as llama.cpp names it (MOSTLY_Q4_K_M -> `q4_k_m`): a Q4_K_M
        file's most common tensor type is q5_0 or q4_k, neither the name users know it by."""
        code = _field(self.readers[0], "general.file_type")
        try:
            kind = _gguf().LlamaFileType(int(code))
        except (TypeError, ValueError):
            return None  # absent, or a code newer than the gguf package
        if kind == _gguf().LlamaFileType.GUESSED:
            return None
        return kind.name.lower().removeprefix("mostly_").removeprefix("all_")

    def open_checkpoint(self) -> GGUFCheckpoint:
        cfg = self.config
        heads = int(cfg["num_attention_heads"])
        return GGUFCheckpoint(
            self.readers, self.architecture, heads, int(cfg.get("num_key_value_heads", heads))
        )

    def weight_map(self, architecture, config) -> dict[str, list[str]]:
        return architecture.gguf_weight_map(config)

    def sampling_defaults(self) -> SamplingDefaults | None:
        """The `general.sampling.*` keys llama.cpp's converter copies from the model's
        generation_config.json; None when the file has none."""
        return from_gguf(lambda key: _field(self.readers[0], key))

    def write_tokenizer(self, out: Path) -> TokenizerInfo:
        from .gguf_tokenizer import tokenizer_from_gguf

        try:
            tok = tokenizer_from_gguf(self.readers[0])
        except ValueError as e:
            raise ModelSourceError(f"{self.files[0]}: {e}") from e
        tok.save(out)
        if tok.chat_template:
            (out / CHAT_TEMPLATE_FILE).write_text(tok.chat_template, encoding="utf-8")
        eos = sorted({i for i in (tok.eos_token_id, tok.eot_token_id) if i is not None})
        token = tok.tokenizer.id_to_token
        return TokenizerInfo(
            files=["tokenizer.json", "tokenizer_config.json"],
            bos_token_id=tok.bos_token_id,
            eos_token_ids=eos,
            add_bos_token=tok.add_bos_token,
            chat_template=CHAT_TEMPLATE_FILE if tok.chat_template else None,
            bos_token=token(tok.bos_token_id) if tok.bos_token_id is not None else None,
            eos_token=token(tok.eos_token_id) if tok.eos_token_id is not None else None,
        )


def gguf_config(reader, arch: Architecture, tensor_names: set[str]) -> dict:
    """An HF-style config.json dict from GGUF metadata, via the architecture's key table."""
    prefix = arch.gguf_arch
    cfg: dict = {"architectures": [arch.hf_name]}
    for key, hf_key in (arch.gguf_config_keys or {}).items():
        value = _field(reader, f"{prefix}.{key}")
        if value is not None:
            cfg[hf_key] = value
    if "vocab_size" not in cfg:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            cfg["vocab_size"] = len(tokens.data)
    _rope_config(reader, prefix, cfg)
    if "rope_freqs.weight" in tensor_names and ROPE_FREQ_FACTORS_KEY not in cfg:
        raise ModelSourceError("GGUF rope_freqs tensor is not in the first file of the set")
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    if arch.gguf_config_fixup is not None:
        arch.gguf_config_fixup(cfg)
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[hf_key] = int(value)
    return cfg


def _rope_tensor(reader, name: str) -> list[float] | None:
    for t in reader.tensors:
        if t.name == name:
            return [float(v) for v in np.asarray(t.data, dtype=np.float32).reshape(-1)]
    return None


def _rope_config(reader, prefix: str, cfg: dict) -> None:
    """RoPE settings as llama.cpp's converter stores them: `rope.scaling.type` linear; a
    `rope_freqs` tensor of per-dimension divisors for Llama 3.1+ (the llama3 parameters
    themselves are not kept); `rope_factors_long` / `rope_factors_short` tensors plus the
    original context and cos/sin multiplier for LongRoPE (Phi-3); `rope.dimension_count`
    below the head size for partial rotary."""
    heads = int(cfg.get("num_attention_heads") or 1)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // heads)
    rope_dims = _field(reader, f"{prefix}.rope.dimension_count")
    if rope_dims is not None and head_dim and int(rope_dims) != head_dim:
        cfg["partial_rotary_factor"] = int(rope_dims) / head_dim
    scaling = _field(reader, f"{prefix}.rope.scaling.type")
    freqs = _rope_tensor(reader, "rope_freqs.weight")
    long, short = (_rope_tensor(reader, f"rope_factors_{k}.weight") for k in ("long", "short"))
    if scaling == "linear":
        factor = float(_field(reader, f"{prefix}.rope.scaling.factor") or 1.0)
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        raise ModelSourceError(f"GGUF rope scaling {scaling!r} is not supported yet")
    if freqs is not None:
        cfg[ROPE_FREQ_FACTORS_KEY] = freqs
    if (long is None) != (short is None):
        raise ModelSourceError("GGUF has only one of rope_factors_long / rope_factors_short")
    if long is not None:
        original = _field(reader, f"{prefix}.rope.scaling.original_context_length")
        if original is None:
            raise ModelSourceError(
                "GGUF LongRoPE factors without rope.scaling.original_context_length"
            )
        longrope = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
        longrope["original_max_position_embeddings"] = int(original)
        attention = _field(reader, f"{prefix}.rope.scaling.attn_factor")
        if attention is not None:
            longrope["attention_factor"] = float(attention)
        cfg["rope_scaling"] = longrope


def check_gguf_file(path: Path) -> list:
    """What can be checked of a GGUF without the model definitions (and so without TVM):
    every shard of a split set present, each a readable GGUF, an architecture named, every
    tensor of a type tallow reads. Returns the readers."""
    files = split_files(path)
    readers = [_open_reader(f) for f in files]
    if _field(readers[0], "general.architecture") is None:
        raise ModelSourceError(f"{path}: GGUF metadata has no general.architecture")
    supported = supported_types()
    for r in readers:
        for t in r.tensors:
            if t.tensor_type not in supported:
                raise ModelSourceError(
                    f"{path}: tensor {t.name} has GGML type {t.tensor_type.name}, which tallow "
                    f"cannot read; supported: {', '.join(sorted(s.name for s in supported))}"
                )
    return readers


def gguf_source(spec: str, path: Path) -> GGUFModelSource:
    from tallow.model_defs.registry import UnknownArchitectureError, get_gguf_architecture

    files = split_files(path)
    readers = check_gguf_file(path)
    arch_name = _field(readers[0], "general.architecture")
    try:
        arch = get_gguf_architecture(str(arch_name))
    except UnknownArchitectureError as e:
        raise ModelSourceError(f"{path}: {e}") from e
    names = {t.name for r in readers for t in r.tensors}
    config = gguf_config(readers[0], arch, names)
    return GGUFModelSource(
        spec=spec,
        kind="gguf",
        folder=path.parent,
        config=config,
        weight_files=files,
        gguf_file=files[0],
        files=files,
        architecture=arch,
        readers=readers,
    )
