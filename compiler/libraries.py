"""Several libraries in one artifact: which targets a compile builds, what the manifest says
about each library, and which weight set each one takes.

One compile (`--target cuda -sm 80 -sm 90 --target metal --target cpu --cpu x86-64-v3`)
lowers and builds the model once per target and converts the weights once. Today every
target takes the same parameters (names, shapes, dtypes, quantization: the model definition
does not depend on the target), so all libraries share the weight set `main`. A target whose
module asked for other parameters would get a weight set of its own, named after its library
(`Manifest.weight_sets`), rather than a silently wrong layout.
"""

from __future__ import annotations

from tallow.runtime.errors import TargetError
from tallow.runtime.manifest import MAIN_WEIGHTS, LibraryInfo

from .backends import get_backend
from .backends.base import TargetSpec
from .target import resolve_target


def resolve_targets(options) -> list[TargetSpec]:
    """One `TargetSpec` per library `options` asks for: each `--target`, and for the CPU one
    per `--cpu` level (`-sm` gathers every arch into one CUDA library)."""
    names = check_target_options(options)
    levels = list(options.cpu or [])
    sms = options.sms
    # No --dtype: the natural dtype is chosen once the source is read (`phases.read_model`
    # checks it against every target then); a spec does not depend on it, and every
    # target accepts f32.
    dtype = options.dtype or "f32"
    specs: list[TargetSpec] = []
    for name in names:
        for level in (levels or [None]) if _takes_cpu_level(name) else [None]:
            specs.append(resolve_target(name, dtype, sms if _takes_sms(name) else None, level))
    files = [spec.library_name for spec in specs]
    if len(set(files)) != len(files):
        raise TargetError(f"two targets build the same library: {', '.join(files)}")
    return specs


def check_target_options(options) -> list[str]:
    """The target names (default cpu), after the checks that need no TVM: no target twice,
    `--cpu` and `--sm` only with a target that takes them."""
    names = [options.target] if isinstance(options.target, str) else list(options.target)
    if not names:
        names = ["cpu"]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise TargetError(
            f"--target {', '.join(twice)} given twice; repeat -sm or --cpu for more variants"
        )
    if options.cpu and not any(_takes_cpu_level(n) for n in names):
        raise TargetError("--cpu applies to --target cpu only")
    if options.sms and not any(_takes_sms(n) for n in names):
        raise TargetError("--sm applies to --target cuda only")
    return names


def _takes_cpu_level(name: str) -> bool:
    return get_backend(name).accepts_cpu_level


def _takes_sms(name: str) -> bool:
    return get_backend(name).accepts_sms


def artifact_suffix(specs: list[TargetSpec]) -> str:
    """The target part of the default artifact name: `cpu`, `cuda-sm_90-metal-cpu`, ..."""
    return "-".join(spec.suffix for spec in specs)


def weight_set_for(weight_sets: dict, params: list, spec: TargetSpec) -> str:
    """The name of the weight set whose parameters are `params` (adding a set when none is):
    `main` for the first target, and for every target whose module takes the same ones."""
    for name, existing in weight_sets.items():
        if existing == params:
            return name
    name = MAIN_WEIGHTS if not weight_sets else spec.backend.library_stem(spec)
    weight_sets[name] = list(params)
    return name


def library_info(spec: TargetSpec, weights: str = MAIN_WEIGHTS) -> LibraryInfo:
    """The manifest's entry for the library built for `spec`."""
    return LibraryInfo(
        file=spec.library_name,
        device=spec.kind,
        target=spec.label,
        platform=spec.platform,
        tvm_target=dict(spec.tvm_target),
        host=dict(spec.host) if spec.host else None,
        cpu_level=spec.cpu_level,
        cpu_features=list(spec.cpu_features),
        cuda_archs=list(spec.report.archs or []),
        weights=weights,
        details=spec.details,
    )


def weight_shard_prefix(name: str) -> str:
    """Shard files of weight set `name`: `params_NNNNN.safetensors` for `main`."""
    return "params" if name == MAIN_WEIGHTS else f"params-{name}"
