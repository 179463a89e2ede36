"""Building an `Engine` for an artifact: KV-cache budget → page count, scheduler limits.

The KV budget is `kv_cache_mem_mb` when given; otherwise a fraction of the memory left
after the weights (GPU: free device memory; CPU: available RAM). It is never more than
`max_num_seqs` full context windows, since more could not be used.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from .devices import device_kind
from .draft_proposer import DraftProposer, check_same_vocabulary
from .engine import Engine
from .errors import TallowError
from .library_select import LibraryChoice, choose_library
from .manifest import DTYPE_BYTES, Manifest
from .model_runner import KVCacheConfig, TVMModelRunner
from .scheduler import SchedulerConfig
from .speculation_costs import calibrated
from .speculative import NgramProposer, SpeculationPolicy, SpeculativeConfig
from .tp_runner import runner_class

log = logging.getLogger(__name__)


@dataclass
class EngineOptions:
    device: str | None = None
    max_num_seqs: int = 16
    prefill_chunk_size: int = 512
    max_num_batched_tokens: int | None = None  # default: prefill_chunk_size
    kv_cache_mem_mb: float | None = None
    memory_fraction: float | None = None  # GPU: of free device memory; CPU: of available RAM
    prefix_cache: bool = True
    prefix_cache_max_tokens: int = 8192
    threads: int | None = None  # CPU kernel threads; None: every usable CPU but one
    # Batch-invariant outputs: a request's tokens and logprobs the same bits whatever runs
    # beside it (docs/cpu-kernels.md#deterministic-mode); no prefix cache.
    deterministic: bool = False
    # Speculative decoding (`speculative.py`); None: off.
    speculative: SpeculativeConfig | None = None
    # Tensor-parallel workers; None: as many as the artifact was compiled for (the only
    # count it runs with: another is refused).
    tensor_parallel: int | None = None


@dataclass(frozen=True)
class KVPlan:
    bytes_per_token: int
    total_tokens: int
    budget_bytes: int


def kv_bytes_per_token(manifest: Manifest) -> int:
    return manifest.kv_cache.bytes_per_token()


def _free_memory(choice: LibraryChoice) -> int:
    """Memory the weights and the KV cache can share: available RAM, or the GPU's total."""
    return device_kind(choice.device).memory_bytes(choice.index)


def plan_kv_cache(
    manifest: Manifest,
    options: EngineOptions,
    weight_bytes: int,
    choice: LibraryChoice | None = None,
) -> KVPlan:
    """The KV cache's size on the device `choice` runs on (default: `options.device`'s)."""
    choice = choice or choose_library(manifest, options.device)
    per_token = kv_bytes_per_token(manifest)
    wanted = options.max_num_seqs * manifest.kv_cache.context_window
    if options.kv_cache_mem_mb is not None:
        if options.kv_cache_mem_mb <= 0:
            raise TallowError(f"--kv-cache-mem must be positive (got {options.kv_cache_mem_mb})")
        budget = int(options.kv_cache_mem_mb * 2**20)
    else:
        fraction = options.memory_fraction
        if fraction is None:
            fraction = device_kind(choice.device).default_memory_fraction
        if not 0 < fraction <= 1:
            raise TallowError(f"--gpu-memory-fraction must be in (0, 1] (got {fraction})")
        budget = int(fraction * max(0, _free_memory(choice) - weight_bytes))
    tokens = min(budget // per_token, wanted)
    page = manifest.kv_cache.page_size
    tokens = tokens // page * page
    if tokens < page:
        raise TallowError(
            f"the KV cache budget ({budget / 2**20:.1f} MB) holds less than one page of "
            f"{page} tokens ({per_token * page / 2**20:.2f} MB); raise --kv-cache-mem"
        )
    return KVPlan(per_token, tokens, budget)


def _weight_bytes(manifest: Manifest, choice: LibraryChoice) -> int:
    params = manifest.params_for(choice.library)
    return sum(DTYPE_BYTES.get(p.dtype, 1) * math.prod(p.shape) for p in params)


def build_engine(folder: str | Path, options: EngineOptions | None = None) -> Engine:
    options = options or EngineOptions()
    manifest = Manifest.read(Path(folder))
    choice = choose_library(manifest, options.device)
    weight_bytes = _weight_bytes(manifest, choice)
    plan = plan_kv_cache(manifest, options, weight_bytes, choice)
    chunk = options.prefill_chunk_size
    # Prefix-cache entries are live sequences in the KV cache too.
    page = manifest.kv_cache.page_size
    entries = options.prefix_cache_max_tokens // page if options.prefix_cache else 0
    runner = runner_class(manifest, options.tensor_parallel)(
        folder,
        device=choice,
        threads=options.threads,
        kv=KVCacheConfig(
            max_batch_size=options.max_num_seqs + entries,
            max_total_tokens=plan.total_tokens,
            prefill_chunk_size=chunk,
        ),
    )
    # At most max_num_seqs per step, and never above a CUDA artifact's compiled batch bound.
    runner.max_batch_size = min(options.max_num_seqs, runner.max_batch_size)
    runner.batch_invariant = options.deterministic
    if options.deterministic:
        _warn_if_not_batch_invariant(runner)
    log.info(  # -v shows it; `tallow serve` says nothing unless something needs the user
        "KV cache: %d pages x %d tokens = %d tokens (%.1f MB, %d bytes/token)",
        runner.num_pages,
        runner.page_size,
        runner.num_pages * runner.page_size,
        plan.total_tokens * plan.bytes_per_token / 2**20,
        plan.bytes_per_token,
    )
    config = SchedulerConfig(
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens or chunk,
        prefill_chunk_size=chunk,
        enable_prefix_cache=options.prefix_cache,
        prefix_cache_max_tokens=options.prefix_cache_max_tokens,
        deterministic=options.deterministic,
    )
    tok = runner.tokenizer
    engine = Engine(
        runner, tokenizer=tok.tokenizer, eos_token_ids=tok.eos_token_ids, scheduler_config=config
    )
    engine.scheduler.speculation = _speculation(options, runner, weight_bytes)
    return engine


def _speculation(
    options: EngineOptions, runner: TVMModelRunner, weight_bytes: int
) -> SpeculationPolicy | None:
    spec = options.speculative
    if spec is None:
        return None
    if options.deterministic:
        # Verification runs several tokens of a sequence through other kernels than decode:
        # the bits would depend on what was proposed. Off, so the promise holds.
        log.warning("--deterministic: speculative decoding is off (its bits would differ)")
        return None
    spec = dataclasses.replace(spec, row_cost=runner.device_kind.verify_row_cost)
    spec = calibrated(spec, runner)  # this model's and device's step costs, measured
    if spec.draft is None:
        return SpeculationPolicy(spec, NgramProposer(spec.ngram_max, spec.ngram_min))
    draft, draft_bytes = _draft_runner(spec.draft, options, runner)
    spec = dataclasses.replace(spec, proposal_cost=draft_bytes / max(weight_bytes, 1))
    log.info("draft model %s: %.2f of the model's weight bytes", spec.draft, spec.proposal_cost)
    return SpeculationPolicy(spec, DraftProposer(draft))


def _draft_runner(
    folder: str, options: EngineOptions, target: TVMModelRunner
) -> tuple[TVMModelRunner, int]:
    """The draft artifact on the model's device, its cache sized for the model's batch;
    and its weight bytes."""
    manifest = Manifest.read(Path(folder))
    choice = choose_library(manifest, options.device)
    runner = TVMModelRunner(
        folder,
        device=choice,
        threads=options.threads,
        kv=KVCacheConfig(
            max_batch_size=options.max_num_seqs, prefill_chunk_size=options.prefill_chunk_size
        ),
    )
    if not runner.supports_generation:
        raise TallowError(f"--draft {folder}: an embedding-only artifact cannot draft")
    check_same_vocabulary(
        target.tokenizer.tokenizer,
        runner.tokenizer.tokenizer,
        target.vocab_size,
        runner.vocab_size,
    )
    return runner, _weight_bytes(manifest, choice)


def _warn_if_not_batch_invariant(runner: TVMModelRunner) -> None:
    """Say at start what `--deterministic` cannot promise for the library the runner loaded."""
    # the library the runner loaded (artifacts with several), else the artifact's target
    library = getattr(runner, "library", None) or runner.manifest.target
    gap = batch_invariance_gap(runner.device_kind.name, library.details or {})
    if gap:
        log.warning("--deterministic: %s", gap)


# What the tests check of GPU libraries (tests/test_opencl_kernels.py), and what they cannot.
GPU_CHECKED = (
    "tallow's GPU schedules of batch_decode's matmuls (dlight LowBatchGEMV, f32 and f16 "
    "activations) and RMSNorm give a row the same bits at every batch size, run as OpenCL C "
    "on a CPU; not checked for this {kind} library: its paged-attention kernels, the compiled "
    "sampler, the {shuffles} its reductions lower to, and any run on a {kind} device"
)
SHUFFLES = {"cuda": "warp shuffles", "metal": "simdgroup shuffles"}


def batch_invariance_gap(kind: str, details: dict) -> str | None:
    """What keeps a library of device kind `kind` (`details`: its manifest details) from a
    checked batch-invariant decode, in words; None when nothing does
    (docs/cpu-kernels.md#deterministic-mode)."""
    if kind != "cpu":
        return GPU_CHECKED.format(kind=kind, shuffles=SHUFFLES.get(kind, "shuffles"))
    if details.get("batch_invariant_decode") or details.get("int8_decode_tiles") != "avx2":
        # built since every CPU level's decode kernels are invariant, or AVX-512 VNNI tiles
        # or float decode kernels (both invariant before, and unchanged)
        return None
    return (
        "this CPU library was compiled before its AVX2 decode tiles became batch-invariant: "
        "from 8 sequences on (12 for q5k and q6k weights) they sum a row in another order, so "
        "a request's outputs can depend on the batch; compile the artifact again"
    )
