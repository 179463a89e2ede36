"""`tallow compile`: a readable list of phases from a model source to an artifact folder.

Each phase reads and extends one `CompileState`. The artifact is written into a temporary
folder next to its destination and renamed at the very end, so a failed compile leaves
nothing half-written behind.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tallow.runtime.errors import TallowError

from .progress import Progress
from .source import ModelSource
from .target import TargetSpec


@dataclass
class CompileOptions:
    model: str
    target: str = "cpu"
    sms: list[int] | None = None  # --target cuda: SM architectures, e.g. [80, 90]
    dtype: str = "f32"
    quant: str | None = None  # weight format; None: a GGUF keeps its types, floats use dtype
    output: Path = Path("artifacts")
    name: str | None = None
    gguf_file: str | None = None
    page_size: int = 16
    context_window: int | None = None
    overwrite: bool = False
    quiet: bool = False
    # "generate": a generation artifact, which also serves embeddings; "embed": embeddings only
    # (no logits, decode functions, sampler or untied lm_head weights).
    task: str = "generate"
    pooling: str | None = None  # embeddings: "mean" or "last"; None: as the source says


@dataclass
class CompileState:
    """What the phases have produced so far."""

    options: CompileOptions
    progress: Progress
    source: ModelSource | None = None
    target: TargetSpec | None = None
    architecture: Any = None  # model_defs.registry.Architecture
    config: Any = None  # model_defs.config.DecoderConfig
    module: Any = None  # the nn.Module
    ir_module: Any = None  # tvm IRModule after export, then after lowering
    params: list = field(default_factory=list)  # weights.ParamSpec, library order
    checkpoint: Any = None  # names/shape/get over the source tensors
    weight_map: dict[str, list[str]] = field(default_factory=dict)
    quant_plan: Any = None  # quant_plan.QuantPlan
    work_dir: Path | None = None
    final_dir: Path | None = None
    param_infos: list = field(default_factory=list)
    tokenizer_info: Any = None
    functions: list[str] = field(default_factory=list)
    embedding: Any = None  # runtime.manifest.EmbeddingInfo


def _phases() -> list[tuple[str, Callable[[CompileState], str]]]:
    from . import phases

    return [
        ("read model config", phases.read_config),
        ("build the model module", phases.build_module),
        ("export functions to Relax", phases.export_functions),
        ("add the token sampler", phases.add_sampler),  # a no-op for --task embed
        ("lower through the Relax pipeline", phases.lower),
        ("build the library", phases.build_library),
        ("convert weights", phases.convert_weights),
        ("copy tokenizer and chat template", phases.copy_tokenizer),
        ("write manifest", phases.write_manifest),
    ]


def compile_model(options: CompileOptions) -> Path:
    """Run every phase; return the artifact folder."""
    state = CompileState(options=options, progress=Progress(quiet=options.quiet))
    phases = _phases()
    options.output.mkdir(parents=True, exist_ok=True)
    try:
        for i, (title, phase) in enumerate(phases, start=1):
            state.progress.phase(i, len(phases), title)
            state.progress.done(phase(state))
        assert state.work_dir is not None and state.final_dir is not None
        state.work_dir.chmod(0o755)  # mkdtemp makes it private; an artifact is for sharing
        if state.final_dir.exists():
            shutil.rmtree(state.final_dir)
        state.work_dir.rename(state.final_dir)
        state.work_dir = None
        return state.final_dir
    finally:
        if state.work_dir is not None:
            shutil.rmtree(state.work_dir, ignore_errors=True)


def make_work_dir(state: CompileState, name: str) -> None:
    """Pick the destination and create the private folder the phases write into."""
    out = state.options.output
    state.final_dir = out / name
    if state.final_dir.exists() and not state.options.overwrite:
        raise TallowError(
            f"{state.final_dir} already exists; pass --overwrite to replace it or --name to "
            f"choose another name"
        )
    state.work_dir = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=out))
