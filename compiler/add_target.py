"""`tallow compile --add-target ARTIFACT --target ...`: more libraries for an existing artifact.

The model source is read for its config only (the weights are not converted again), each
new target is lowered and built as in a full compile, and the libraries are checked to take
the artifact's weights as they are: same parameter names, shapes, dtypes and formats. So a CI
matrix can compile the weights and one target in one job and add the other targets in
parallel jobs.

Nothing in the artifact changes until everything is built: the new files are written into a
private `.NAME.*.partial` folder inside the artifact, then moved in with `os.replace` (atomic
on one file system), the manifest last, so a reader sees the old manifest or the new one,
never one naming a missing library.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from tallow.runtime.errors import ArtifactError, TallowError
from tallow.runtime.integrity import record_checksums
from tallow.runtime.manifest import MAIN_WEIGHTS, Manifest

from .libraries import resolve_targets
from .phases import write_weight_set
from .pipeline import (
    CompileOptions,
    CompileState,
    library_phases,
    make_partial_dir,
    run_phases,
)
from .progress import Progress
from .quant_plan import QuantPlan
from .target import DTYPES
from .weights import ParamSpec


@dataclass
class AddTargetOptions:
    targets: list[str]
    cpu: list[str] | None = None
    sms: list[int] | None = None
    model: str | None = None  # default: the source the artifact was compiled from
    gguf_file: str | None = None
    overwrite: bool = False  # rebuild a library the artifact already has
    quiet: bool = False


def add_targets(folder: Path, options: AddTargetOptions) -> Path:
    """Build `options.targets` into the artifact `folder`; return the folder."""
    folder = Path(folder)
    manifest = Manifest.read(folder)
    _check_versions(folder, manifest)
    if manifest.tensor_parallel_degree > 1:
        raise TallowError(
            f"{folder} was compiled with --tensor-parallel {manifest.tensor_parallel_degree}: "
            "adding a target to it is not supported yet; compile the model again with both"
        )
    compile_options = _compile_options(folder, manifest, options)
    state = CompileState(options=compile_options, progress=Progress(quiet=options.quiet))
    state.targets = resolve_targets(compile_options)
    have = {lib.file for lib in manifest.libraries}
    clash = [spec.library_name for spec in state.targets if spec.library_name in have]
    if clash and not options.overwrite:
        raise TallowError(
            f"{folder} already has {', '.join(clash)}; pass --overwrite to rebuild it"
        )
    # The artifact's weight sets, as the library phases compare them.
    state.weight_sets = {
        name: [ParamSpec(p.name, tuple(p.shape), p.dtype) for p in params]
        for name, params in ((MAIN_WEIGHTS, manifest.params), *manifest.weight_sets.items())
    }
    known_sets = set(state.weight_sets)
    phases = [
        ("read model config", lambda s: _read_source(s, manifest, folder)),
        *library_phases(state.targets),
        ("convert weights for new layouts", lambda s: _convert_new_sets(s, known_sets)),
        ("update the manifest", lambda s: _commit(s, folder, manifest, known_sets)),
    ]
    state.final_dir = folder  # what a full disk error names
    try:
        run_phases(state, phases)
    finally:
        if state.work_dir is not None:
            shutil.rmtree(state.work_dir, ignore_errors=True)
    return folder


def _check_versions(folder: Path, manifest: Manifest) -> None:
    """Every library of an artifact comes from one tallow and one TVM (the runtime loads
    each with the same conventions)."""
    here = {
        "tallow": importlib.metadata.version("tallow"),
        "TVM": importlib.metadata.version("apache-tvm"),
    }
    built = {"tallow": manifest.tallow_version, "TVM": manifest.tvm_version}
    for name in here:
        if here[name] != built[name]:
            raise TallowError(
                f"{folder} was compiled with {name} {built[name]}; this is {name} "
                f"{here[name]}: recompile the whole artifact to add targets"
            )


def _compile_options(folder: Path, manifest: Manifest, options: AddTargetOptions):
    """The artifact's own compile settings (dtype, task, KV dtype and page size, context
    window)."""
    flag_of = {v: k for k, v in DTYPES.items()}
    flag = flag_of[manifest.dtype]
    model = options.model or manifest.model.source
    gguf_file = options.gguf_file
    if gguf_file is None and not model.endswith(".gguf"):
        ggufs = [n for n in manifest.model.source_files if n.endswith(".gguf")]
        gguf_file = ggufs[0] if len(ggufs) == 1 else None
    return CompileOptions(
        model=model,
        target=list(options.targets),
        cpu=options.cpu,
        sms=options.sms,
        dtype=flag,
        output=folder.parent,
        name=folder.name,
        gguf_file=gguf_file,
        page_size=manifest.kv_cache.page_size,
        kv_dtype=flag_of[manifest.kv_cache.dtype],
        context_window=manifest.kv_cache.context_window,
        quiet=options.quiet,
        task=manifest.task,
        pooling=manifest.embedding.pooling if manifest.embedding else None,
    )


def _read_source(state: CompileState, manifest: Manifest, folder: Path) -> str:
    from .phases import read_model

    summary = read_model(state)
    config = json.loads(json.dumps(state.config.to_dict()))
    if config != manifest.model.config:
        differ = sorted(
            k
            for k in config.keys() | manifest.model.config.keys()
            if config.get(k) != manifest.model.config.get(k)
        )
        raise ArtifactError(
            f"{state.source.spec} is not the model this artifact was compiled from "
            f"(config differs in: {', '.join(differ)}); pass its source with --model"
        )
    # The weight formats the artifact has, whatever `--quant` produced them.
    types = {p.name: p.quant for p in manifest.params if p.quant != "none"}
    state.quant_plan = QuantPlan(manifest.quantization, types, state.quant_plan.reused)
    state.work_dir = make_partial_dir(folder, "add-target")
    return summary


def _convert_new_sets(state: CompileState, known: set[str]) -> str:
    new = {name: params for name, params in state.weight_sets.items() if name not in known}
    for name, params in new.items():
        state.other_param_infos[name] = write_weight_set(state, name, params)
    if not new:
        return "none: every new library takes the artifact's weights as they are"
    return f"new weight set(s): {', '.join(new)}"


def _commit(state: CompileState, folder: Path, manifest: Manifest, known: set[str]) -> str:
    work = state.work_dir
    new_files = [lib.file for lib in state.libraries]
    new_shards = sorted({p.shard for infos in state.other_param_infos.values() for p in infos})
    checksums = dict(manifest.checksums or {})
    checksums.update(record_checksums(work, [*new_files, *new_shards], sampled=new_shards))
    replaced = {lib.file for lib in state.libraries}
    libraries = [lib for lib in manifest.libraries if lib.file not in replaced]
    updated = replace(
        manifest,
        libraries=[*libraries, *state.libraries],
        weight_sets={**manifest.weight_sets, **state.other_param_infos},
        checksums=dict(sorted(checksums.items())) if manifest.checksums is not None else None,
    )
    updated.write(work)
    for name in [*new_files, *new_shards]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(work / name, folder / name)
    os.replace(work / "manifest.yaml", folder / "manifest.yaml")  # last: the switch
    added = ", ".join(lib.file for lib in state.libraries)
    return f"{folder}: added {added} ({len(updated.libraries)} libraries)"
