"""Kernel replay of a whole model (`tests/kernel_replay.py`, `kernel_replay_check.py`):
every kernel of a prefill (two chunks) and a decode step of a tiny f16 q4k Qwen3, the paged
KV cache's included, scheduled as a CUDA build schedules it, run on a Vulkan device through
WebGPU (lavapipe) with the inputs a CPU run of the same kernels saw, and compared kernel by
kernel with the CPU's outputs. docs/gpu-artifacts.md#kernel-replay-of-a-whole-model.

Also here, without a Vulkan device: the schedule bug the replay found (a decode
projection's residual add left outside every kernel) stays fixed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("tvm")

from kernel_replay import STEPS  # noqa: E402
from kernel_replay_check import CACHE_REASON, VIEW_REASON, WMMA, unbound_blocks  # noqa: E402
from wgpu_runner import unavailable  # noqa: E402

needs_wgpu = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def _decode_projection_with_residual():
    """A q4k decode projection in f16 with the residual add an attention output or MLP
    projection has in a decoder (`o_proj(x) + residual`), fused and GPU-scheduled."""
    from opencl_cases import prim_funcs
    from opencl_runner import gpu_scheduled
    from tvm.relax.frontend import nn

    from tallow.model_defs.quant_ops import QuantLinear

    class Residual(nn.Module):
        def __init__(self):
            self.proj = QuantLinear(256, 64, "q4k", "float16")

        def decode(self, x, residual):
            return self.proj(x) + residual

    spec = {"x": nn.spec.Tensor([1, 1, 256], "float16")}
    spec["residual"] = nn.spec.Tensor([1, 1, 64], "float16")
    mod, _ = Residual().export_tvm({"decode": spec})
    scheduled, report = gpu_scheduled(mod, "f16")
    return prim_funcs(scheduled), report


def test_decode_projection_epilogue_runs_on_the_gpu():
    """QuantDecodeGEMV moved only the matmul's first consumer (the f16 cast) into its
    kernel; the residual add after it stayed a loop outside every thread binding, which
    TVM's CUDA build compiles, without an error, to host code reading device memory. The
    whole chain must sit under `blockIdx`."""
    funcs, report = _decode_projection_with_residual()
    (name,) = [n for n in funcs if "quant_matmul" in n]
    assert report["kernels"][name] == "QuantDecodeGEMV"
    assert "add" in name  # the residual add is fused into the projection's kernel
    assert unbound_blocks(funcs[name]) == []


def test_unbound_blocks_sees_a_host_loop():
    """The check above finds a block outside every `blockIdx` binding (the oracle for it)."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def two(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in T.thread_binding(64, thread="blockIdx.x"):
            with T.sblock("inside"):
                v = T.axis.spatial(64, i)
                b[v] = a[v]
        for i in range(64):
            with T.sblock("outside"):
                v = T.axis.spatial(64, i)
                b[v] = b[v] + a[v]

    assert unbound_blocks(two) == ["outside"]


@pytest.fixture(scope="module")
def replayed(tiny_model_dir):
    import kernel_replay
    import kernel_replay_check as check
    from wgpu_runner import WGPUKernels

    model = kernel_replay.build(tiny_model_dir("qwen3_wide"))
    calls = kernel_replay.capture(model)
    return model, calls, check.replay_all(model, calls, WGPUKernels, check.simt_schedule(model))


@pytest.mark.slow
@needs_wgpu
def test_whole_model_kernel_replay(replayed):
    """Every kernel called in a prefill (17 tokens, then a 5-token chunk over the cached
    pages) and a decode step, the paged cache's included, replays on wgpu within f16
    tolerance of the CPU's outputs (`kernel_replay.TOLERANCE`); the wmma prefill matmuls,
    which WebGPU cannot run, replay in their SIMT schedule. The table of every kernel
    (replayed with its error, or why not) is printed."""
    import kernel_replay_check as kr

    model, calls, rows = replayed
    print("\n" + kr.table(rows))
    called = {c.kernel for c in calls}
    assert {c.step for c in calls} == {step for step, _, _ in STEPS}
    # the attention kernels of all three kinds ran, and tallow's merge kernel
    for name in ("batch_prefill_ragged_kv", "batch_prefill_paged_kv", "batch_decode_paged_kv"):
        assert name in called
    assert "tir_attention_merge_state" in called
    by_name = {r.kernel: r for r in rows}
    for name in called:
        row = by_name[name]
        if row.why == WMMA:
            row = by_name[f"{name} (SIMT)"]
        assert row.why is None, f"{name} not replayed: {row.why}"
        assert row.calls == sum(c.kernel == name for c in calls)
    mismatches = {r.kernel: r.failures for r in rows if r.failures}
    assert not mismatches, mismatches
    assert all(r.why in (CACHE_REASON, VIEW_REASON, WMMA) for r in rows if r.why)
    # every scheduled kernel, the cache's included, runs on the GPU (no host loop)
    from opencl_cases import prim_funcs

    assert {n: b for n, f in prim_funcs(model.scheduled).items() if (b := unbound_blocks(f))} == {}


@pytest.mark.slow
@needs_wgpu
def test_replay_sees_a_wrong_kernel(replayed):
    """The comparison is not vacuous: a decode GEMV replayed on the next call's inputs (the
    other layer's weights) is reported as a mismatch."""
    import dataclasses

    import kernel_replay_check as kr
    from opencl_cases import prim_funcs
    from wgpu_runner import WGPUKernels

    model, calls, _ = replayed
    name = "fused_quant_matmul_q4k6_add"  # o_proj + residual, both layers in decode
    first, second = [c for c in calls if c.kernel == name and c.step == "decode"]
    swapped = dataclasses.replace(first, after=second.after)
    func = prim_funcs(model.scheduled)[name]
    row = kr._replay_kernel(name, func, [swapped], WGPUKernels, "QuantDecodeGEMV")
    assert row.failures and row.units > 100 * kr.TOLERANCE
