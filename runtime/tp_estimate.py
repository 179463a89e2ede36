"""Tensor parallelism on paper (`tallow inspect --tensor-parallel N [--gpu NAME]`): what each
step all-reduces, and on a named GPU the estimated all-reduce time next to the weight
streaming time at N workers and at one. Estimates from data-sheet figures, not measurements.

Every decoder layer all-reduces twice, whatever its family: after `o_proj` and after the
MLP's `down_proj`; a mixture-of-experts layer also all-reduces once for its MLP, after its
experts' down projection (its shared expert's partial output, where it has one, is summed
in before it; docs/tensor-parallel.md). Each all-reduce sums, per token, one hidden-size
vector in the compute dtype, so a step of T tokens (a decode of B sequences: T = B)
all-reduces 2 x layers x T x hidden x dtype bytes.

A ring all-reduce of S bytes over N GPUs sends (and receives) 2(N-1)/N x S bytes per GPU
(a reduce-scatter and an all-gather, each N-1 steps of S/N); the time below is that over the
GPU's link bandwidth in one direction. It is the bandwidth term only: a decode step's
all-reduces are a few KiB each, where NCCL's per-call latency (microseconds), not bandwidth,
dominates; only a multi-GPU machine can measure it.

Weight streaming: a decode step reads every weight once (roofline.py); at N workers each
GPU reads 1/N of the split weights (heads, MLP and expert widths), all of the replicated
ones (norms, router, embedding rows, vocab head), and 1/N of the KV cache (its KV heads).

Runtime-only: reads the manifest, imports nothing from TVM or the compiler.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ArtifactError
from .manifest import DTYPE_BYTES, Manifest
from .roofline import GPUSpec, decode_roofline, gpu_spec

ALLREDUCES_PER_LAYER = 2  # after o_proj; after down_proj (a MoE layer: after its experts)


def ring_bytes(volume: int, degree: int) -> float:
    """Bytes each GPU sends in a ring all-reduce of `volume` bytes over `degree` GPUs."""
    return 2 * (degree - 1) / degree * volume


@dataclass(frozen=True)
class TPEstimate:
    degree: int
    layers: int
    hidden: int
    dtype: str
    batch: int  # sequences in a decode step
    prefill: int  # tokens in a prefill step
    gpu: GPUSpec | None = None
    step_bytes_one: int = 0  # one GPU: weights + embedding rows + KV read per decode step
    step_bytes_worker: int = 0  # one of N workers: its share of the same

    @property
    def allreduces_per_step(self) -> int:
        return ALLREDUCES_PER_LAYER * self.layers

    @property
    def bytes_per_token(self) -> int:
        """What one all-reduce sums per token: a hidden-size vector in the compute dtype."""
        return self.hidden * DTYPE_BYTES[self.dtype]

    def volume(self, tokens: int) -> int:
        """Bytes all-reduced in a step of `tokens` tokens (all its all-reduces together)."""
        return self.allreduces_per_step * tokens * self.bytes_per_token

    def allreduce_seconds(self, tokens: int) -> float:
        """Bandwidth term of a step's all-reduces: ring bytes over the one-way link speed."""
        return ring_bytes(self.volume(tokens), self.degree) / (self.gpu.link_gbs * 1e9)

    def streaming_seconds(self, step_bytes: int) -> float:
        return step_bytes / (self.gpu.bandwidth_gbs * 1e9)

    def describe(self) -> str:
        n, kib = self.degree, 1024
        lines = [
            f"tensor parallel {n} (an estimate on paper, not a measurement)",
            f"  all-reduces per layer: {ALLREDUCES_PER_LAYER} (after o_proj; after down_proj, "
            "or after a MoE layer's experts and shared expert)",
            f"  all-reduces per step:  {self.allreduces_per_step} ({self.layers} layers)",
            f"  bytes per all-reduce per token: {self.bytes_per_token:,} "
            f"(hidden {self.hidden} x {self.dtype})",
            f"  decode, batch {self.batch}: {self.volume(self.batch):,} bytes all-reduced "
            f"per step ({self.volume(self.batch) / kib:,.1f} KiB)",
            f"  prefill of {self.prefill} tokens: {self.volume(self.prefill):,} bytes "
            f"({self.volume(self.prefill) / kib**2:,.1f} MiB)",
            f"  ring all-reduce: each GPU sends 2(N-1)/N = {2 * (n - 1) / n:g} x those bytes",
        ]
        if self.gpu is None:
            return "\n".join(lines)
        g, ms = self.gpu, 1e3
        one = self.streaming_seconds(self.step_bytes_one)
        mine = self.streaming_seconds(self.step_bytes_worker)
        ar = self.allreduce_seconds(self.batch)
        lines += [
            f"on {g.name}: link {g.link_gbs:g} GB/s per direction ({g.link_source}); "
            f"memory {g.bandwidth_gbs:g} GB/s",
            f"  decode all-reduce time, bandwidth term: {ar * ms:.4f} ms per step "
            "(latency not included: it dominates messages this small)",
            f"  prefill all-reduce time, bandwidth term: "
            f"{self.allreduce_seconds(self.prefill) * ms:.4f} ms",
            f"  weight streaming per decode step: {one * ms:.3f} ms on 1 GPU "
            f"({self.step_bytes_one / 2**30:.3f} GiB), {mine * ms:.3f} ms on each of {n} "
            f"({self.step_bytes_worker / 2**30:.3f} GiB)",
            f"  decode speed-up bound: {one / (mine + ar):.2f}x "
            "(streaming time at 1 GPU / streaming plus all-reduce bandwidth time at N)",
        ]
        return "\n".join(lines)


def tp_estimate(
    manifest: Manifest,
    degree: int,
    is_split: Callable[[str], bool],
    batch: int = 1,
    prefill: int = 512,
    gpu: str | None = None,
    context: int = 512,
) -> TPEstimate:
    """The estimate for `manifest`'s model at `degree` workers; `is_split(name)` says which
    weights are divided among them (the manifest's shard rules, or the compiler's)."""
    if degree < 2 or degree & (degree - 1):
        raise ArtifactError(f"--tensor-parallel {degree}: must be a power of two >= 2")
    if batch < 1 or prefill < 1:
        raise ArtifactError(f"batch and prefill must be >= 1 (got {batch}, {prefill})")
    config = manifest.model.config
    if manifest.dtype not in DTYPE_BYTES:
        raise ArtifactError(f"compute dtype {manifest.dtype!r} has no known size")
    layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    if gpu is None:
        return TPEstimate(degree, layers, hidden, manifest.dtype, batch, prefill)
    spec = gpu_spec(gpu)
    if spec.link_gbs is None:
        raise ArtifactError(f"{spec.name}: {spec.link_source}; tensor parallelism needs several")
    roof = decode_roofline(manifest, spec.name, batch, context)
    split = sum(
        math.prod(p.shape) * _itemsize(p.dtype) for p in manifest.params if is_split(p.name)
    )
    # each worker: its 1/N of the split weights and of the KV heads, all of the rest
    worker = roof.step_bytes - split + split // degree - roof.kv_bytes + roof.kv_bytes // degree
    return TPEstimate(
        degree, layers, hidden, manifest.dtype, batch, prefill, spec, roof.step_bytes, worker
    )


def _itemsize(dtype: str) -> int:
    return {**DTYPE_BYTES, "uint8": 1, "int8": 1, "int32": 4}[dtype]
