"""The compile phases, in the order `pipeline.compile_model` runs them.

Each takes the `CompileState`, extends it, and returns a one-line summary for the log.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json

from tallow.model_defs.config import ConfigError
from tallow.model_defs.decoder import HIDDEN_FUNCTION, TASKS
from tallow.model_defs.registry import UnknownArchitectureError, get_architecture
from tallow.model_defs.tensor_parallel import check_degree, full_shapes, local_config
from tallow.runtime.errors import ModelSourceError
from tallow.runtime.integrity import record_checksums
from tallow.runtime.manifest import (
    FORMAT_VERSION,
    MAIN_WEIGHTS,
    EmbeddingInfo,
    KVCacheInfo,
    Manifest,
    ManifestModel,
    TensorParallelInfo,
)

from . import tokenizer_files
from .compute_dtype import choose_compute_dtype
from .kv_layout import check_page_size, choose_kv_dtype
from .libraries import (
    artifact_suffix,
    library_info,
    resolve_targets,
    weight_set_for,
    weight_shard_prefix,
)
from .pipeline import CompileState, make_work_dir
from .pooling import choose_pooling
from .quant_plan import FLOAT_FORMATS, check_quant_option, make_plan
from .source import resolve_source, sha256_file
from .target import DTYPES
from .weights import ParamSpec, check_sources_present, check_weight_map, write_weight_shards


def read_config(state: CompileState) -> str:
    summary = read_model(state)
    opts, plan = state.options, state.quant_plan
    task_suffix = "-embed" if opts.task == "embed" else ""
    suffix = artifact_suffix(state.targets)
    weights = weights_label(plan, opts.dtype)
    tp_suffix = f"-tp{opts.tensor_parallel}" if opts.tensor_parallel > 1 else ""
    name = opts.name or f"{state.source.name}-{weights}-{suffix}{task_suffix}{tp_suffix}"
    make_work_dir(state, name)
    return summary


def weights_label(plan, dtype: str) -> str:
    """The weights part of the default artifact name: the float dtype, or the block format
    followed by the activations' dtype when that is not f32 (`q4k-f16`; f32, the CPU's, is
    left out so CPU artifact names stay as they were)."""
    if not plan.types or dtype == "f32":
        return plan.label
    return f"{plan.label}-{dtype}"


def read_model(state: CompileState) -> str:
    """The source's config, architecture, weight map and quantization plan (no files written)."""
    opts = state.options
    state.source = source = resolve_source(opts.model, gguf_file=opts.gguf_file)
    # float weights (`--quant f16`) are in the compute dtype: they name it
    by_quant = opts.dtype is None and opts.quant in FLOAT_FORMATS
    choice = choose_compute_dtype(
        opts.quant if by_quant else opts.dtype,
        [opts.target] if isinstance(opts.target, str) else list(opts.target),
        source.config,
        source.kind,
        requested_by="--quant" if by_quant else "--dtype",
    )
    state.options = opts = dataclasses.replace(opts, dtype=choice.dtype)
    state.dtype_source = choice.source
    if not state.targets:
        state.targets = resolve_targets(opts)
    for spec in state.targets:
        spec.backend.check_dtype(opts.dtype)
    kv_dtype = choose_kv_dtype(opts.kv_dtype, opts.dtype, [s.backend for s in state.targets])
    check_page_size(opts.page_size)
    state.options = opts = dataclasses.replace(opts, kv_dtype=kv_dtype)
    state.target = state.targets[0]
    try:
        state.architecture = arch = get_architecture(source.config)
        state.config = config = arch.config_from_hf(source.config)
    except (UnknownArchitectureError, ConfigError) as e:
        raise ModelSourceError(f"{source.spec}: {e}") from e
    if opts.context_window:
        config.context_window_size = min(opts.context_window, config.context_window_size)
    check_quant_option(opts.quant, opts.dtype)
    if opts.task not in TASKS:
        raise ModelSourceError(f"--task {opts.task!r}: choose from {', '.join(TASKS)}")
    state.checkpoint = checkpoint = source.open_checkpoint()
    state.weight_map = source.weight_map(arch, config)
    if opts.task == "embed":
        # Embeddings never read the output head: its weights stay out of the artifact.
        state.weight_map.pop("lm_head.weight", None)
    try:
        pooling, pooling_source = choose_pooling(source.folder, source.name, opts.pooling)
    except ModelSourceError:
        if opts.task == "embed":
            raise
        pooling, pooling_source = "mean", "default"  # a generation artifact still compiles
    state.embedding = EmbeddingInfo(
        function=HIDDEN_FUNCTION,
        pooling=pooling,
        dimensions=config.hidden_size,
        pooling_source=pooling_source,
    )
    check_sources_present(state.weight_map, checkpoint.names())
    state.quant_plan = plan = make_plan(
        opts.quant,
        opts.dtype,
        state.weight_map,
        checkpoint.shape,
        checkpoint.source_type,
        tied_output=config.tie_word_embeddings,
        allow_requantize=opts.allow_requantize,
        num_experts=config.num_experts,
        file_type=source.file_type,
    )
    for spec in state.targets:
        spec.backend.check_formats(plan.module_types())
    try:
        check_degree(config, opts.tensor_parallel, plan.module_types())
    except ConfigError as e:
        raise ModelSourceError(f"{source.spec}: {e}") from e
    # fused weights whose parts keep different types become one parameter per run
    state.weight_map = plan.param_weight_map(state.weight_map)
    return (
        f"{arch.hf_name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads; weights {plan.label}; "
        f"task {opts.task} ({pooling} pooling from {pooling_source})"
    )


def build_module(state: CompileState) -> str:
    dtype = DTYPES[state.options.dtype]
    state.module = state.architecture.build(
        local_config(state.config, state.options.tensor_parallel),
        dtype,
        state.target.tvm(),
        quant=state.quant_plan.module_types(),
        task=state.options.task,
        kv_dtype=DTYPES[state.options.kv_dtype],
    )
    return f"{type(state.module).__name__} ({dtype})"


def export_functions(state: CompileState) -> str:
    module = state.module
    spec = module.get_default_spec()
    # The artifact-wide function list; a library's static-row decode functions are its own
    # (`target.details.static_decode_functions`), since another target's library lacks them.
    state.functions = list(spec)
    buckets = state.options.decode_buckets
    if buckets is None:
        buckets = state.target.backend.static_decode_buckets()
    if buckets and "batch_decode" in spec:
        static = module.decode_bucket_spec(buckets)
        spec.update(static)
        state.target.report.static_decode_functions = {
            str(rows): name for rows, name in zip(buckets, static, strict=True)
        }
    state.ir_module, named_params = module.export_tvm(spec=spec)
    local = [
        ParamSpec(name, tuple(int(d) for d in p.shape), str(p.dtype)) for name, p in named_params
    ]
    # The artifact stores whole weights; each tensor-parallel worker cuts its share at load.
    state.params, state.shard_rules = full_shapes(
        local, state.config, state.options.tensor_parallel
    )
    # Check the checkpoint against the module now, before the expensive build.
    checkpoint = state.checkpoint
    check_weight_map(
        state.weight_map,
        state.params,
        checkpoint.names(),
        checkpoint.shape,
        state.quant_plan.qtype,
    )
    return f"{len(state.functions)} functions, {len(state.params)} parameters"


def add_sampler(state: CompileState) -> str:
    from .sampler_function import SAMPLER_FUNCTION, add_sampler_function

    if state.options.task == "embed":
        return "none: an embedding artifact samples no tokens"
    vocab = state.config.vocab_size
    state.ir_module = add_sampler_function(state.ir_module, vocab, state.target.backend)
    state.functions.append(SAMPLER_FUNCTION)
    return f"{SAMPLER_FUNCTION} over {vocab} tokens ({state.target.backend.name} kernel)"


def lower(state: CompileState) -> str:
    from .relax_pipeline import lower_module

    state.ir_module = lower_module(state.ir_module, state.target)
    return f"{len(state.ir_module.functions)} functions after lowering"


def build_library(state: CompileState) -> str:
    spec = state.target
    name = spec.library_name  # lib/<what it runs on>.so, or a .tar of objects (Metal)
    path = state.work_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    spec.backend.build(state.ir_module, spec, path)
    weights = weight_set_for(state.weight_sets, state.params, spec)
    state.libraries.append(library_info(spec, weights))
    state.module = state.ir_module = None  # the next target lowers its own
    return f"{name}: {path.stat().st_size / 2**20:.1f} MiB (weight set {weights})"


def write_weight_set(state: CompileState, set_name: str, params: list) -> list:
    """The shards of one weight set (`main`, or a library's own layout), named by the set."""
    return write_weight_shards(
        state.work_dir,
        params,
        state.weight_map,
        state.checkpoint,
        state.progress,
        state.quant_plan,
        prefix=weight_shard_prefix(set_name),
    )


def convert_weights(state: CompileState) -> str:
    """Every weight set once (today one, `main`, whatever the number of targets)."""
    if not state.weight_sets:  # no library built (a caller running single phases)
        state.weight_sets[MAIN_WEIGHTS] = state.params
    for set_name, params in state.weight_sets.items():
        infos = write_weight_set(state, set_name, params)
        if set_name == MAIN_WEIGHTS:
            state.param_infos = infos
        else:
            state.other_param_infos[set_name] = infos
    infos = [*state.param_infos, *(i for s in state.other_param_infos.values() for i in s)]
    shards = {p.shard for p in infos}
    size = sum((state.work_dir / s).stat().st_size for s in shards)
    sets = len(state.weight_sets)
    return (
        f"{len(infos)} tensors in {len(shards)} shard(s), {size / 2**20:.1f} MiB "
        f"({sets} weight set{'s' if sets > 1 else ''} for {len(state.libraries)} librar"
        f"{'ies' if len(state.libraries) != 1 else 'y'})"
    )


def copy_tokenizer(state: CompileState) -> str:
    state.tokenizer_info = tokenizer_files.write(state.source, state.config, state.work_dir)
    state.sampling_defaults = tokenizer_files.sampling_defaults(state.source)
    info = state.tokenizer_info
    template = "with chat template" if info.chat_template else "no chat template"
    sampling = state.sampling_defaults.describe()
    return f"{', '.join(info.files)} ({template}); sampling defaults: {sampling}"


def write_manifest(state: CompileState) -> str:
    src, cfg, opts = state.source, state.config, state.options
    dtype = DTYPES[opts.dtype]
    files = {p.name: sha256_file(p) for p in src.input_files()}
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        tallow_version=importlib.metadata.version("tallow"),
        tvm_version=importlib.metadata.version("apache-tvm"),
        model=ManifestModel(
            name=src.name,
            architecture=state.architecture.hf_name,
            source=src.spec,
            source_kind=src.kind,
            source_files=dict(sorted(files.items())),
            config=json.loads(json.dumps(cfg.to_dict())),
        ),
        dtype=dtype,
        quantization=state.quant_plan.label,
        kv_cache=KVCacheInfo(
            page_size=opts.page_size,
            dtype=DTYPES[opts.kv_dtype],
            context_window=cfg.context_window_size,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            **_window_info(cfg),
        ),
        libraries=state.libraries,
        functions=state.functions,
        params=state.param_infos,
        tokenizer=state.tokenizer_info,
        task=opts.task,
        embedding=state.embedding,
        checksums=_artifact_checksums(state),
        weight_sets=state.other_param_infos,
        dtype_source=state.dtype_source,
        sampling_defaults=state.sampling_defaults,
        tensor_parallel=_tensor_parallel_info(state),
    )
    manifest.write(state.work_dir)
    return f"{state.final_dir}"


def _tensor_parallel_info(state: CompileState) -> TensorParallelInfo | None:
    degree = state.options.tensor_parallel
    if degree == 1:
        return None
    shards = {name: rule.to_dict() for name, rule in state.shard_rules.items()}
    return TensorParallelInfo(degree=degree, shards=shards)


def _window_info(cfg) -> dict:
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.layer_window(i) is not None]
    return {"sliding_window": cfg.sliding_window, "windowed_layers": layers} if layers else {}


def _artifact_checksums(state: CompileState) -> dict:
    """Size and sha256 of every file: the libraries, weight shards, tokenizer files and chat
    template (see `runtime.integrity`)."""
    info = state.tokenizer_info
    infos = [*state.param_infos, *(i for s in state.other_param_infos.values() for i in s)]
    shards = {p.shard for p in infos}
    names = {*shards, *info.files, *(lib.file for lib in state.libraries)}
    if info.chat_template:
        names.add(info.chat_template)
    names = {n for n in names if (state.work_dir / n).is_file()}
    return record_checksums(state.work_dir, names, sampled=shards)
