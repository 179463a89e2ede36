"""The model card (`README.md`) `tallow push` uploads with an artifact, written from its manifest.

The YAML front matter is huggingface_hub's `ModelCardData`, so the hub indexes the repository
under `library_name: tallow` with tags for the quantization and the targets, and links the
source model (`base_model`) when the artifact was compiled from a hub id.
"""

from __future__ import annotations

import re
from pathlib import Path

from tallow.runtime.manifest import Manifest

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_PIPELINE = {"generate": "text-generation", "embed": "feature-extraction"}


def source_hub_id(manifest: Manifest) -> str | None:
    """The source model's hub id, when it was compiled from one (not from a local path)."""
    source = manifest.model.source
    if _HUB_ID.fullmatch(source) and not Path(source).exists():
        return source
    return None


def target_rows(manifest: Manifest) -> list[tuple[str, str]]:
    """(library file, what it runs on) for each library of the artifact."""
    return [(lib.file, f"{lib.target} ({lib.platform})") for lib in manifest.libraries]


def card_tags(manifest: Manifest) -> list[str]:
    kinds = sorted({lib.device for lib in manifest.libraries})
    return ["tallow", "tvm", manifest.quantization, *kinds, manifest.model.architecture]


def render_model_card(manifest: Manifest, repo: str, sizes: dict[str, int]) -> str:
    """The card's text; `repo` is `org/name`, `sizes` the uploaded files' sizes in bytes."""
    from huggingface_hub import ModelCardData

    base = source_hub_id(manifest)
    data = ModelCardData(
        library_name="tallow",
        tags=card_tags(manifest),
        base_model=base,
        pipeline_tag=_PIPELINE.get(manifest.task),
    )
    m = manifest.model
    source = f"[{base}](https://huggingface.co/{base})" if base else f"`{m.name}` (a local copy)"
    rows = [
        ("Source model", f"{source}, read as {m.source_kind}"),
        ("Architecture", m.architecture),
        ("Quantization", manifest.quantization),
        ("Compute dtype", f"{manifest.dtype} ({manifest.dtype_source})"),
        ("KV cache", f"{manifest.kv_cache.dtype}, pages of {manifest.kv_cache.page_size} tokens"),
        ("Context window", f"{manifest.kv_cache.context_window} tokens"),
        ("Task", manifest.task),
        ("tallow", manifest.tallow_version),
        ("Apache TVM", manifest.tvm_version),
    ]
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# {repo.split('/', 1)[1]}",
        "",
        f"An ahead-of-time compiled tallow artifact of {source}: the weights, the tokenizer "
        "and a library per target, built with Apache TVM.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in rows),
        "",
        "## Targets",
        "",
        "| Library | Runs on | Size |",
        "|---|---|---|",
        *(f"| `{lib}` | {what} | {_mib(sizes.get(lib))} |" for lib, what in target_rows(manifest)),
        "",
        "## Use",
        "",
        f"Serve it with tallow {manifest.tallow_version} or newer. tallow is not on PyPI (a "
        "package named `tallow` there is not this project): install it from a clone of its "
        "source (`pip install .`), or from the wheel `python -m build --wheel` builds there "
        f"(`pip install tallow-{manifest.tallow_version}-py3-none-any.whl`).",
        "",
        "```",
        f"tallow serve hf://{repo}      # downloads the weights and only the library it runs",
        f'tallow generate hf://{repo} --prompt "Hello"',
        f"tallow verify hf://{repo}     # hashes every file against manifest.yaml",
        "```",
        "",
        "## Files",
        "",
        "`manifest.yaml` records the size and sha256 of every other file; a pull checks them "
        "before first use.",
        "",
        "| File | Size |",
        "|---|---|",
        *(f"| `{name}` | {_mib(size)} |" for name, size in sorted(sizes.items())),
        "",
    ]
    return "\n".join(lines)


def _mib(size: int | None) -> str:
    if size is None:
        return "?"
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
