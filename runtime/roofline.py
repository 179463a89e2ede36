"""The memory roofline of decoding an artifact on a named GPU: bytes read per step, tok/s bound.

A decode step of B sequences at context C reads every weight once (the matrix-vector kernels
stream each weight byte once per step, whatever B up to the decode batch tile), the B looked-up
rows of the embedding table (all of it when the output head is tied to it), and each
sequence's K and V for its C past positions (a windowed layer reads at most its window). At
batch sizes up to 64 decode is memory-bound on every GPU below: arithmetic intensity is about
2·B FLOP per weight element, under every ridge point here (peak FLOP/s ÷ bandwidth ≥ 34
FLOP/byte), so tok/s ≤ B × bandwidth ÷ bytes per step. Activations, norms and logits are
ignored (< 0.1 % of the bytes for an 8B model).

Runtime-only: reads the manifest, imports nothing from TVM or the compiler.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import ArtifactError
from .manifest import DTYPE_BYTES, Manifest


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bandwidth_gbs: float  # memory bandwidth, GB/s (10^9 bytes)
    f16_tflops: float  # peak dense f16 tensor/matrix throughput, TFLOP/s (no sparsity)
    source: str
    # GPU-to-GPU bandwidth in one direction, GB/s (tensor parallelism, tp_estimate.py): the
    # data sheets give NVLink's total over both directions, half of it each way. None: one
    # GPU per machine.
    link_gbs: float | None = None
    link_source: str = ""


# Vendor data sheets (dense figures; "with sparsity" numbers are twice these).
GPUS = {
    g.name: g
    for g in (
        # NVIDIA H200 datasheet (SXM): 4.8 TB/s HBM3e, FP16 Tensor Core 1,979 TFLOPS sparse.
        GPUSpec(
            "H200",
            4800,
            989.5,
            "NVIDIA H200 Tensor Core GPU datasheet, SXM",
            450,
            "NVLink 900 GB/s both ways, H200 datasheet",
        ),
        # NVIDIA H100 datasheet (SXM): 3.35 TB/s, FP16 Tensor Core 1,979 TFLOPS sparse.
        GPUSpec(
            "H100 SXM",
            3350,
            989.5,
            "NVIDIA H100 Tensor Core GPU datasheet, SXM",
            450,
            "NVLink 900 GB/s both ways, H100 datasheet",
        ),
        # NVIDIA A100 datasheet (80GB SXM): 2,039 GB/s, FP16 Tensor Core 312 TFLOPS dense.
        GPUSpec(
            "A100 80GB",
            2039,
            312,
            "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM",
            300,
            "NVLink 600 GB/s both ways, A100 datasheet",
        ),
        # NVIDIA L4 datasheet: 300 GB/s, FP16 Tensor Core 242 TFLOPS sparse.
        GPUSpec(
            "L4",
            300,
            121,
            "NVIDIA L4 Tensor Core GPU datasheet",
            32,
            "no NVLink: PCIe Gen4 x16 64 GB/s both ways, L4 datasheet",
        ),
        # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): 1,008 GB/s GDDR6X,
        # FP16 Tensor 165.2 TFLOPS dense with FP32 accumulate (330.3 with FP16 accumulate).
        GPUSpec(
            "RTX 4090",
            1008,
            165.2,
            "NVIDIA Ada GPU architecture whitepaper, Table 2",
            32,
            "no NVLink: PCIe 4.0 x16, about 32 GB/s each way",
        ),
        # Apple M2 Max (38-core GPU) tech specs: 400 GB/s; Apple states 13.6 TFLOPS (FP32);
        # Apple GPUs run f16 matrix math (simdgroup matrices) at the same peak.
        GPUSpec(
            "M2 Max",
            400,
            13.6,
            "Apple M2 Max press release (Jan 2023), 38-core GPU",
            link_source="one GPU per machine",
        ),
        # Apple M3 Max (40-core GPU) tech specs: 400 GB/s (the 30-core part has 300 GB/s);
        # Apple gives no TFLOPS figure: 40 cores x 128 ALUs x 2 x 1.6 GHz ~= 16.4 TFLOPS.
        GPUSpec(
            "M3 Max",
            400,
            16.4,
            "Apple MacBook Pro (Nov 2023) tech specs, 40-core GPU",
            link_source="one GPU per machine",
        ),
    )
}

_ITEMSIZE = {**DTYPE_BYTES, "uint8": 1, "int8": 1, "int32": 4}  # GGUF blocks are uint8


def _words(name: str) -> list[str]:
    """A GPU name as lower-case words, letters and digits apart: "H100-SXM", "h100 sxm" and
    "NVIDIA H100 SXM" alike; "A100 80GB" and "A100-80G" alike."""
    words = re.findall(r"[a-z]+|\d+", name.lower())
    return [w for w in words if w not in ("nvidia", "geforce", "apple", "gb", "g")]


def gpu_spec(name: str) -> GPUSpec:
    """The GPU `name` means: the one whose name it spells (spaces, dashes and case aside), or
    else the only one whose name holds all its words ("H100" is the H100 SXM, "4090" the RTX
    4090); several candidates or none is an error naming them."""
    asked = _words(name)
    for key, spec in GPUS.items():
        if _words(key) == asked:
            return spec
    found = [key for key in GPUS if asked and set(asked) <= set(_words(key))]
    if len(found) == 1:
        return GPUS[found[0]]
    if found:
        raise ArtifactError(f"GPU {name!r} could be {' or '.join(found)}; name one")
    raise ArtifactError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")


def _nbytes(shape, dtype: str) -> int:
    try:
        return math.prod(shape) * _ITEMSIZE[dtype]
    except KeyError:
        raise ArtifactError(f"parameter dtype {dtype!r} has no known size") from None


@dataclass(frozen=True)
class DecodeRoofline:
    gpu: GPUSpec
    batch: int
    context: int
    weight_bytes: int  # weights streamed once per step
    embedding_bytes: int  # embedding rows looked up this step
    kv_bytes: int  # K and V read by attention, all sequences
    kv_bytes_per_token: int  # one position of one sequence, all layers

    @property
    def step_bytes(self) -> int:
        return self.weight_bytes + self.embedding_bytes + self.kv_bytes

    @property
    def step_seconds(self) -> float:
        return self.step_bytes / (self.gpu.bandwidth_gbs * 1e9)

    @property
    def tokens_per_second(self) -> float:
        """Upper bound on decode tok/s summed over the batch."""
        return self.batch / self.step_seconds

    def describe(self) -> str:
        gib = 2**30
        return "\n".join(
            [
                f"decode roofline on {self.gpu.name} ({self.gpu.bandwidth_gbs:g} GB/s, "
                f"{self.gpu.f16_tflops:g} TFLOP/s f16; {self.gpu.source})",
                f"  batch {self.batch}, context {self.context}",
                f"  weights read per step: {self.weight_bytes / gib:.3f} GiB",
                f"  embedding rows:        {self.embedding_bytes / 2**20:.3f} MiB",
                f"  KV cache read:         {self.kv_bytes / gib:.3f} GiB "
                f"({self.kv_bytes_per_token} bytes per position)",
                f"  bytes per step:        {self.step_bytes / gib:.3f} GiB "
                f"-> {self.step_seconds * 1e3:.3f} ms",
                f"  upper bound: {self.tokens_per_second:,.1f} tok/s "
                f"({self.tokens_per_second / self.batch:,.1f} per sequence)",
            ]
        )


def _is_embedding(name: str) -> bool:
    return "embed_tokens" in name or name.endswith("token_embd.weight")


def decode_roofline(manifest: Manifest, gpu: str, batch: int = 1, context: int = 512):
    """The bytes one decode step of `batch` sequences at `context` positions reads, and the
    tok/s bound that follows on `gpu` (a key of `GPUS`)."""
    if batch < 1 or context < 0:
        raise ArtifactError(f"batch must be >= 1 and context >= 0 (got {batch}, {context})")
    spec = gpu_spec(gpu)
    tied = bool(manifest.model.config.get("tie_word_embeddings", False))
    weights = embedding = 0
    for p in manifest.params:
        size = _nbytes(p.shape, p.dtype)
        if _is_embedding(p.name) and not tied:
            embedding += min(batch, p.shape[0]) * size // p.shape[0]
        else:
            weights += size
    kv = manifest.kv_cache
    per_layer = kv.bytes_per_token() // kv.num_layers  # a K and a V row per KV head
    windowed = set(kv.windowed_layers)
    positions = sum(
        min(context, kv.sliding_window) if i in windowed and kv.sliding_window else context
        for i in range(kv.num_layers)
    )
    return DecodeRoofline(
        gpu=spec,
        batch=batch,
        context=context,
        weight_bytes=weights,
        embedding_bytes=embedding,
        kv_bytes=batch * per_layer * positions,
        kv_bytes_per_token=kv.bytes_per_token(),
    )
