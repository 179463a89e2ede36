"""What the runtime does differently per device kind, in one table instead of `if kind ==`.

One `DeviceKind` per target kind an artifact can be built for (cpu, cuda, metal): how to open
the device, where the KV cache's memory budget comes from, whether the logits a forward
returns already are host memory, and so on. Only the TVM runtime is used here (never
`tvm.relax` or `tallow.compiler`), so a deployed machine needs `libtvm_runtime` alone.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import ArtifactError, TallowError


def available_ram(index: int = 0) -> int:
    """Bytes of RAM the system could give this process now (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _device_total_memory(kind: str) -> Callable[[int], int]:
    def total(index: int) -> int:
        import tvm

        dev = tvm.runtime.device(kind, index)
        if not dev.exist:
            raise TallowError(f"no {kind} device {index} found")
        return int(dev.total_global_memory)

    return total


def _load_cuda_runtime(tvm, built_for: str) -> None:
    """Load TVM's CUDA device API (a separate library in runtime-only mode).

    It links the driver library `libcuda.so.1`; on a machine without an NVIDIA driver the
    loader refuses it, which we report as "no CUDA driver" instead of a loader message.
    """
    if tvm.get_global_func("device_api.cuda", allow_missing=True) is not None:
        return
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise ArtifactError(
            f"artifact built for {built_for}; no CUDA driver found on this machine "
            f"(libcuda.so.1: {e})"
        ) from e
    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise ArtifactError(f"cannot load TVM's CUDA runtime {lib.name} ({e})") from e


def _load_metal_runtime(tvm, built_for: str) -> None:
    """Load TVM's Metal device API: in runtime-only mode (`TVM_USE_RUNTIME_LIB=1`, which
    `tallow serve` sets) only `libtvm_runtime` is loaded, and the apache-tvm macOS arm64 wheel
    keeps Metal in `libtvm_runtime_metal.dylib` next to it (as Linux keeps CUDA apart)."""
    if tvm.get_global_func("device_api.metal", allow_missing=True) is not None:
        return
    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_metal.dylib"
    if not lib.is_file():
        raise ArtifactError(
            f"artifact library built for {built_for}; this TVM has no Metal runtime ({lib.name} "
            f"is not in {lib.parent}): install the apache-tvm macOS arm64 wheel (docs/metal.md)"
        )
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise ArtifactError(f"cannot load TVM's Metal runtime {lib.name} ({e})") from e


@dataclass(frozen=True)
class DeviceKind:
    name: str  # TVM's device kind, as in the manifest's target
    # Bytes the weights and the KV cache can share on device `index`: available RAM on the
    # CPU, the device's whole memory on a GPU.
    memory_bytes: Callable[[int], int]
    # Of `memory_bytes` minus the weights, what the KV cache takes unless told: a CPU shares
    # its RAM with everything else, a GPU is the model's alone.
    default_memory_fraction: float
    # Device memory is host memory: tensors pass to and from numpy through DLPack without
    # copies (the forward hands out its logits as a numpy view, not a device handle).
    shares_host_memory: bool
    # One running sequence decodes with `decode` (batch 1 built in, no row padding: 1.7x
    # faster matmuls on the CPU). GPU artifacts keep `batch_decode`: on an H100 the CUDA-graph-
    # captured `decode` was as correct and 4% slower (9.57 against 9.22 ms a step, Qwen3-8B
    # shape q4k, docs/gpu-artifacts.md#the-gpu-check).
    single_sequence_decode: bool
    # The runner sizes TVM's CPU thread pool before the first kernel (cpu_threads.py).
    sets_cpu_threads: bool
    # Key of the loaded library's `details` whose `max_batch_size` bounds the runner's batch
    # (CUDA graphs plan batch_decode's memory for a bounded batch), or None.
    batch_bound_detail: str | None = None
    # Loads what TVM needs before the device exists (the CUDA or Metal device API), or None.
    load_driver: Callable[[object, str], None] | None = None
    # Whether to ask TVM if the device exists (the CPU always does).
    probe: bool = True
    # The weights go into one host mapping with huge pages (host_weights.py), not one TVM
    # allocation each.
    huge_page_weights: bool = False
    # Speculative verification (every fed token's logits, no prefill chunk in the step) runs
    # `batch_decode` over the tokens: the paged cache takes several tokens of one sequence
    # there too, and the decode matmul kernels cost 0.7x the prefill ones at 5 rows (CPU,
    # SmolLM2-135M: 19.7 against 28.3 ms). Elsewhere `batch_prefill` at every position,
    # until the decode functions' CUDA graphs and buckets have been checked with it.
    verifies_in_decode: bool = False
    # A forward's cost per row relative to its fixed cost, for how much to speculate
    # (`speculative.SpeculationPolicy`): measured on the CPU (0.25, SmolLM2-135M Q4_1, one
    # thread, Zen 3); on GPUs decode stays bound by weight reads to large batches, a guess
    # not yet measured on a device.
    verify_row_cost: float = 0.02


DEVICE_KINDS: dict[str, DeviceKind] = {
    "cpu": DeviceKind(
        name="cpu",
        memory_bytes=available_ram,
        default_memory_fraction=0.25,
        shares_host_memory=True,
        single_sequence_decode=True,
        sets_cpu_threads=True,
        probe=False,
        huge_page_weights=True,
        verifies_in_decode=True,
        verify_row_cost=0.25,
    ),
    "cuda": DeviceKind(
        name="cuda",
        memory_bytes=_device_total_memory("cuda"),
        default_memory_fraction=0.9,
        shares_host_memory=False,
        single_sequence_decode=False,
        sets_cpu_threads=False,
        batch_bound_detail="cuda_graph",
        load_driver=_load_cuda_runtime,
    ),
    "metal": DeviceKind(
        name="metal",
        memory_bytes=_device_total_memory("metal"),
        default_memory_fraction=0.9,
        shares_host_memory=False,
        single_sequence_decode=False,
        sets_cpu_threads=False,
        load_driver=_load_metal_runtime,
    ),
}


def device_kind(name: str) -> DeviceKind:
    try:
        return DEVICE_KINDS[name]
    except KeyError:
        raise ArtifactError(
            f"unknown device kind {name!r}; expected one of {', '.join(DEVICE_KINDS)}"
        ) from None


def open_device(tvm, kind: DeviceKind, index: int, built_for: str):
    """TVM's device `kind:index`, with a plain error when this machine has none."""
    if kind.load_driver is not None:
        kind.load_driver(tvm, built_for)
    dev = tvm.runtime.device(kind.name, index)
    if not kind.probe:
        return dev
    try:
        exists = bool(dev.exist)
    except Exception:  # the device API is not registered in this TVM build
        exists = False
    if not exists:
        raise ArtifactError(
            f"artifact built for {built_for}; no {kind.name.upper()} device {index} found"
        )
    return dev
