"""`tallow compile`: a readable list of phases from a model source to an artifact folder.

Each phase reads and extends one `CompileState`. The artifact is written into a temporary
folder next to its destination and renamed at the very end, so a failed compile leaves
nothing half-written behind. A compile that is killed (no cleanup runs) leaves its hidden
`.NAME.*.partial` folder; it records its owner (PID, host, process start time) in it, and the
next compile into the same output folder removes the partial folders whose owner is gone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tallow.runtime.errors import DiskFullError, TallowError, disk_full_reason

from .progress import Progress
from .source import ModelSource
from .target import TargetSpec

log = logging.getLogger(__name__)

OWNER_FILE = ".tallow-owner.json"  # inside a .partial folder: who is writing it


@dataclass
class CompileOptions:
    model: str
    # One target or several (`--target cuda --target cpu`): one library each, the weights
    # converted once (`compiler/libraries.py`).
    target: str | list[str] = "cpu"
    sms: list[int] | None = None  # --target cuda: SM architectures, e.g. [80, 90]
    cpu: list[str] | None = None  # --target cpu: CPU levels, one library each (default native)
    dtype: str | None = None  # --dtype; None: the targets' natural dtype (compute_dtype.py)
    quant: str | None = None  # weight mix or format; None: a GGUF keeps its types, floats dtype
    allow_requantize: bool = False  # --quant may re-encode a GGUF's already quantized weights
    output: Path = Path("artifacts")
    name: str | None = None
    gguf_file: str | None = None
    page_size: int = 16  # --page-size (kv_layout.PAGE_SIZES)
    kv_dtype: str | None = None  # --kv-dtype; None: the compute dtype (kv_layout.py)
    context_window: int | None = None
    overwrite: bool = False
    quiet: bool = False
    # "generate": a generation artifact, which also serves embeddings; "embed": embeddings only
    # (no logits, decode functions, sampler or untied lm_head weights).
    task: str = "generate"
    pooling: str | None = None  # embeddings: "mean" or "last"; None: as the source says
    # Row counts given a static-row `batch_decode_b<n>` each; None: the backend's own
    # (`static_decode_buckets`: CUDA's graph buckets, none on CPU). Tests set it (no CLI flag).
    decode_buckets: tuple[int, ...] | None = None
    # --tensor-parallel: workers the layers are split across (model_defs/tensor_parallel.py)
    tensor_parallel: int = 1


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
    dtype_source: str = "--dtype"  # why the compute dtype (compute_dtype.ComputeDtype.source)
    work_dir: Path | None = None
    final_dir: Path | None = None
    param_infos: list = field(default_factory=list)
    tokenizer_info: Any = None
    sampling_defaults: Any = None  # runtime.sampling_defaults.SamplingDefaults
    functions: list[str] = field(default_factory=list)
    embedding: Any = None  # runtime.manifest.EmbeddingInfo
    targets: list = field(default_factory=list)  # every TargetSpec, in build order
    libraries: list = field(default_factory=list)  # runtime.manifest.LibraryInfo, built so far
    weight_sets: dict = field(default_factory=dict)  # set name -> [ParamSpec]; "main" first
    other_param_infos: dict = field(default_factory=dict)  # set name -> [ParamInfo] (not main)
    shard_rules: dict = field(default_factory=dict)  # param name -> tensor_parallel.ShardRule


Phase = tuple[str, Callable[[CompileState], str]]


def library_phases(targets: list[TargetSpec]) -> list[Phase]:
    """The phases that build one library, once per target (titled with the target when
    there are several)."""
    from . import phases

    steps = [
        ("build the model module", phases.build_module),
        ("export functions to Relax", phases.export_functions),
        ("add the token sampler", phases.add_sampler),  # a no-op for --task embed
        ("lower through the Relax pipeline", phases.lower),
        ("build the library", phases.build_library),
    ]
    out: list[Phase] = []
    for spec in targets:
        for title, step in steps:
            title = f"{title} ({spec.label})" if len(targets) > 1 else title
            out.append((title, _for_target(spec, step)))
    return out


def _for_target(spec: TargetSpec, step: Callable[[CompileState], str]):
    def run(state: CompileState) -> str:
        state.target = spec
        return step(state)

    return run


def _phases(targets: list[TargetSpec]) -> list[Phase]:
    from . import phases

    return [
        ("read model config", phases.read_config),
        *library_phases(targets),
        ("convert weights", phases.convert_weights),
        ("copy tokenizer and chat template", phases.copy_tokenizer),
        ("write manifest", phases.write_manifest),
    ]


def compile_model(options: CompileOptions) -> Path:
    """Run every phase; return the artifact folder."""
    from .libraries import resolve_targets

    check_options(options)  # before anything imports TVM (4 s, 10-20 s on a busy machine)
    state = CompileState(options=options, progress=Progress(quiet=options.quiet))
    state.targets = resolve_targets(options)  # --cpu native asks TVM's LLVM for the CPU
    phases = _phases(state.targets)
    made = _missing_parents(options.output)
    try:
        with disk_full_as_error(options.output, "create the output folder"):
            options.output.mkdir(parents=True, exist_ok=True)
        run_phases(state, phases)
        assert state.work_dir is not None and state.final_dir is not None
        state.work_dir.chmod(0o755)  # mkdtemp makes it private; an artifact is for sharing
        (state.work_dir / OWNER_FILE).unlink(missing_ok=True)
        if state.final_dir.exists():
            shutil.rmtree(state.final_dir)
        state.work_dir.rename(state.final_dir)
        state.work_dir = None
        made = []
        return state.final_dir
    finally:
        if state.work_dir is not None:
            shutil.rmtree(state.work_dir, ignore_errors=True)
        for folder in made:  # folders this compile created for --output, if still empty
            try:
                folder.rmdir()
            except OSError:
                break


def _missing_parents(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def run_phases(state: CompileState, phases: list[Phase]) -> None:
    """Run `phases` in order with a progress line each. A phase that fails on a full disk
    raises `DiskFullError` naming the artifact it was writing and the phase (the caller
    removes its work folder)."""
    for i, (title, phase) in enumerate(phases, start=1):
        state.progress.phase(i, len(phases), title)
        with disk_full_as_error(state.final_dir or state.options.output, title):
            summary = phase(state)
        state.progress.done(summary)


@contextmanager
def disk_full_as_error(destination: Path, step: str) -> Iterator[None]:
    """Turn a write that failed on a full disk (ENOSPC, EDQUOT, or a linker saying so) into
    one `DiskFullError` line naming `destination`; other errors pass through."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        reason = disk_full_reason(e)
        if reason is None:
            raise
        raise DiskFullError(
            f"disk full: no space left on the device holding {destination} "
            f"({step}: {reason}); nothing was written: free some space there and compile again"
        ) from e


def check_options(options: CompileOptions) -> None:
    """The checks that need neither TVM nor the network, so a mistyped option or model path
    is reported in a second, not after TVM has loaded."""
    from .kv_layout import check_page_size, choose_kv_dtype
    from .libraries import check_target_options
    from .quant_plan import check_quant_name
    from .source import check_source

    check_target_options(options)
    check_quant_name(options.quant)
    check_page_size(options.page_size)
    if options.kv_dtype is not None:
        choose_kv_dtype(options.kv_dtype, "f32", backends=[])  # the name; targets come later
    if options.context_window is not None and options.context_window < 1:
        raise TallowError(f"--context-window must be at least 1 (got {options.context_window})")
    tp = options.tensor_parallel
    if tp < 1 or tp & (tp - 1):
        raise TallowError(f"--tensor-parallel {tp}: must be a power of two (1, 2, 4, ...)")
    check_source(options.model, options.gguf_file)


def make_work_dir(state: CompileState, name: str) -> None:
    """Pick the destination and create the private folder the phases write into."""
    out = state.options.output
    state.final_dir = out / name
    if state.final_dir.exists() and not state.options.overwrite:
        raise TallowError(
            f"{state.final_dir} already exists; pass --overwrite to replace it or --name to "
            f"choose another name"
        )
    state.work_dir = make_partial_dir(out, name)


def make_partial_dir(parent: Path, name: str) -> Path:
    """A private `.NAME.*.partial` folder in `parent` recording its owner (after removing
    the ones whose compile was killed)."""
    parent.mkdir(parents=True, exist_ok=True)  # a failed compile may have removed it
    remove_stale_partials(parent)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=parent))
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid())}
    try:
        (work / OWNER_FILE).write_text(json.dumps(owner), encoding="utf-8")
    except BaseException:
        # A folder with a half-written record (a full disk) would never count as stale.
        shutil.rmtree(work, ignore_errors=True)
        raise
    return work


def _start_time(pid: int) -> str | None:
    """When process `pid` started (Linux: /proc), to tell a reused PID from the owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, starttime in clock ticks


def _owner_alive(owner: dict) -> bool:
    """Whether the process that wrote a partial folder may still be running. A folder from
    another host, or an unreadable record, counts as alive: it is never ours to delete."""
    try:
        pid, host, start = int(owner["pid"]), owner["host"], owner.get("start")
    except (KeyError, TypeError, ValueError):
        return True
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    now = _start_time(pid)
    return start is None or now is None or now == start  # a different start: a reused PID


def remove_stale_partials(out: Path) -> list[Path]:
    """Remove the `.*.partial` folders in `out` left by compiles that were killed (their
    owning process is gone); return them. A folder without an owner record (an older
    tallow's, or one being created right now) is left alone."""
    removed = []
    for path in sorted(out.glob(".*.partial")):
        record = path / OWNER_FILE
        if not path.is_dir() or not record.is_file():
            continue
        try:
            owner = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict) and not _owner_alive(owner):
            log.warning(
                "removing %s, left by a compile (pid %s) that was killed", path, owner["pid"]
            )
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
