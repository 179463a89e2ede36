"""What every compile target provides (`TargetBackend`), what a resolved target is
(`TargetSpec`), and what the compile learned about it (`BuildReport`).

A backend answers every target-specific question the compiler asks, so the phases and the
Relax pipeline stay target-neutral: which options it accepts, the TVM target, the Relax passes
it adds at the pipeline's hooks, the pass that schedules every TIR kernel, the pass context,
how the library is built and named, and which token-sampler kernel goes into the artifact.
A new target is one module: a `TargetBackend` subclass passed to `register_backend`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tallow.runtime.errors import TargetError

DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


@dataclass
class BuildReport:
    """Facts about one build, written to the manifest as `target.details`.

    Each pass or build step sets the fields it knows; `to_details` drops the unset ones, so an
    artifact records only what applied to its target. Field order is the key order of the
    manifest. A backend with facts of its own subclasses this with more fields.
    """

    # target resolution
    archs: list[str] | None = None  # CUDA: every SM the fatbin holds SASS for
    scheduled_for: str | None = None  # CUDA: the arch the TIR was scheduled for (the lowest)
    mcpu: str | None = None  # CPU: LLVM's name of the host CPU the code is tuned for
    host_format: str | None = None  # Metal: how the host code ships
    # lowering
    tir_config: dict[str, Any] | None = None  # GPU: the TIR pass configuration
    decode_activations: str | None = None  # CPU: int8_decode_pass.ACTIVATIONS or "float32"
    int8_decode_kernels: int | None = None  # CPU: decode matmuls given int8-activation kernels
    int8_decode_tiles: str | None = None  # CPU: "avx512-vnni" or "avx2"
    # CPU: `batch_decode` gives a row the same bits at every batch size (the decode kernels of
    # every CPU level; docs/cpu-kernels.md#deterministic-mode). Absent from libraries built
    # before the AVX2 column tiles served every batch size.
    batch_invariant_decode: bool | None = None
    prefill_activations: str | None = None  # CPU: int8_prefill_pass's ACTIVATIONS or "float32"
    int8_prefill_kernels: int | None = None  # CPU: prefill matmuls given int8 kernels
    # CPU with AMX: a prefill call of at least this many rows runs bf16 products on AMX tiles
    # (`schedules.cpu.amx_prefill`); fewer rows, `prefill_activations`
    prefill_bf16_amx_from_rows: int | None = None
    schedules: dict[str, Any] | None = None  # GPU: rule per kernel, families, tensor-core use
    cuda_graph: dict[str, Any] | None = None  # CUDA: what RewriteCUDAGraph captured
    # rows (as a string) -> the static-row batch-decode function exported for it
    static_decode_functions: dict[str, str] | None = None
    static_decode_evidence: dict[str, Any] | None = None  # CUDA: rules, registers, spills
    # build
    nvcc: str | None = None  # CUDA: nvcc version
    build_driver: str | None = None  # CUDA: "system" driver or the build-time "stub"
    kernels_in_source: int | None = None  # CUDA: __global__ functions generated
    shaders: int | None = None  # Metal: kernel functions generated
    tensor_core_in_source: bool | None = None  # GPU: matrix-unit calls in the device code
    tensor_core_kernels: list[str] | None = None  # GPU: device kernels with matrix-unit calls
    simdgroup_matrices: dict[str, Any] | None = None  # Metal: simdgroup dtypes per shader
    spills: dict[str, Any] | None = None  # CUDA: kernels whose registers spill, per arch
    kernel_resources: dict[str, Any] | None = None  # CUDA: `ptxas -v` per kernel and arch
    spill_repair: dict[str, Any] | None = None  # CUDA: kernels rebuilt with min blocks per SM

    def to_details(self) -> dict[str, Any]:
        """The manifest's `target.details`: the set fields, in field order."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }


@dataclass
class TargetSpec:
    """A target resolved from the user's options: the backend, TVM's target and the report."""

    backend: TargetBackend
    tvm_target: dict[str, Any]
    host: dict[str, Any] | None = None
    report: BuildReport = field(default_factory=BuildReport)
    platform: str = "linux-x86_64"  # OS and machine the host code runs on
    cpu_level: str | None = None  # CPU: the --cpu level
    cpu_features: list[str] = field(default_factory=list)  # CPU: features its code may use

    def tvm(self):
        import tvm

        if self.host is None:
            return tvm.target.Target(self.tvm_target)
        return tvm.target.Target(self.tvm_target, host=self.host)

    @property
    def kind(self) -> str:
        """The device kind the runtime loads the library onto (the manifest's `target.kind`)."""
        return self.backend.device

    @property
    def suffix(self) -> str:
        """The target part of the default artifact name."""
        return self.backend.artifact_suffix(self)

    @property
    def library_name(self) -> str:
        """The library's path in the artifact, named by what it runs on
        (`lib/cpu-x86-64-v3.so`, `lib/cuda-sm_80-sm_90.so`, `lib/metal-arm64.tar`)."""
        return f"lib/{self.backend.library_stem(self)}{self.backend.library_ext(self)}"

    @property
    def label(self) -> str:
        """What the library runs on, in words (the manifest's `libraries[].target`)."""
        return self.backend.target_label(self)

    @property
    def details(self) -> dict[str, Any]:
        """The report as the manifest writes it (read-only view)."""
        return self.report.to_details()


class TargetBackend(ABC):
    """One compile target. Subclasses set `name` and implement the abstract methods; the
    hooks have do-nothing defaults. Methods take the `TargetSpec` and, while lowering, the TVM
    target object built from it (`spec.tvm()`)."""

    name: ClassVar[str]  # what `--target` says, the key in `BACKENDS`
    device: ClassVar[str] = ""  # manifest `target.kind` (the runtime's device); default: name
    accepts_sms: ClassVar[bool] = False  # whether `--sm` applies
    accepts_cpu_level: ClassVar[bool] = False  # whether `--cpu` applies

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A backend derived from another runs on its parent's device unless it says otherwise.
        if "name" in cls.__dict__ and not cls.device:
            cls.device = cls.name

    # --- target resolution ----------------------------------------------------------------
    def resolve(
        self, dtype: str, sms: list[int] | None = None, cpu: str | None = None
    ) -> TargetSpec:
        """Check the options and build the spec (`check_dtype`, then `make_spec`)."""
        if dtype not in DTYPES:
            raise TargetError(
                f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}"
            )
        if sms and not self.accepts_sms:
            from . import BACKENDS

            takes = ", ".join(n for n, b in BACKENDS.items() if b.accepts_sms)
            raise TargetError(f"--sm applies to --target {takes} only")
        if cpu and not self.accepts_cpu_level:
            raise TargetError("--cpu applies to --target cpu only")
        self.check_dtype(dtype)
        return self.make_spec(dtype, sms, cpu)

    def check_dtype(self, dtype: str) -> None:
        """Raise `TargetError` when this target cannot run `dtype` (default: all of DTYPES)."""
        return None

    def check_formats(self, types: dict) -> None:
        """Raise `TargetError` when this target cannot run a weight's block format. `types`:
        parameter name -> format name or a tuple of them (`QuantPlan.module_types`);
        default: every registered format."""
        return None

    def natural_dtype(self, model_dtype: str | None) -> str:
        """The compute dtype without `--dtype` (a DTYPES key). `model_dtype`: the dtype the
        model was trained in, from its config's `torch_dtype` (None for a GGUF or when
        unstated). Default f32: what the CPU runs fastest (no half-precision arithmetic)."""
        return "f32"

    @abstractmethod
    def make_spec(self, dtype: str, sms: list[int] | None, cpu: str | None = None) -> TargetSpec:
        """The TVM target (and host) for checked options, with the report's first facts."""

    def artifact_suffix(self, spec: TargetSpec) -> str:
        return self.name

    def library_stem(self, spec: TargetSpec) -> str:
        """The library's file name without extension: what it runs on."""
        return self.artifact_suffix(spec)

    def library_ext(self, spec: TargetSpec) -> str:
        """`.so`, or `.tar` for objects linked on the running machine (no linker here)."""
        return ".so"

    def target_label(self, spec: TargetSpec) -> str:
        return self.library_stem(spec).replace("-", " ", 1)

    def static_decode_buckets(self) -> tuple[int, ...]:
        """Row counts the runtime pads decode steps to on this target, each exported as a
        static-row `batch_decode_b<n>` (none by default: the symbolic `batch_decode` only)."""
        return ()

    # --- Relax pipeline hooks (see compiler/relax_pipeline.py for where each one runs) -----
    def prepare_for_lowering(self, mod, spec: TargetSpec):
        """`mod` before any pass runs (e.g. function attributes the passes read)."""
        return mod

    def passes_before_fusion(self, spec: TargetSpec, target) -> list:
        """Relax rewrites that must see the model's operators before legalization and fusion."""
        return []

    @abstractmethod
    def schedule_pass(self, spec: TargetSpec, target):
        """The module pass that schedules every fused TIR kernel for this target."""

    def passes_after_memory_planning(self, spec: TargetSpec, target) -> list:
        return []

    def passes_after_vm_lowering(self, spec: TargetSpec, target) -> list:
        return []

    def pass_context(self, spec: TargetSpec):
        """The context lowering and building run in (PassContext configuration)."""
        return contextlib.nullcontext()

    def after_lowering(self, mod, spec: TargetSpec) -> None:
        """Record in `spec.report` what lowering did to `mod` (default: nothing to record)."""
        return None

    # --- build ----------------------------------------------------------------------------
    @abstractmethod
    def build(self, mod, spec: TargetSpec, path: Path) -> None:
        """Generate machine code for the lowered module and write the library to `path`."""

    # --- the compiled token sampler -------------------------------------------------------
    @abstractmethod
    def sampler_kernels(self):
        """The module with `sample_kernel(vocab, vocab)` and `workspace_width(vocab)` for
        `compiler/sampler_function.py`."""

    # --- capabilities ---------------------------------------------------------------------
    def has_tensor_cores(self, target) -> bool:
        """Whether `target` has matrix units a matmul schedule should use."""
        return False
