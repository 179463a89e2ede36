"""GPU-scheduled kernels in f16 and with subgroup-shuffle reductions, run on a Vulkan device
through WebGPU (`tests/wgpu_runner.py`; on a GPU-less machine Mesa's lavapipe), against
numpy: what PoCL and Oclgrind cannot run (no `cl_khr_fp16`; OpenCL lowers reductions for a
warp of 1). docs/gpu-artifacts.md#vulkan-lavapipe-f16-and-subgroups.

The kernels are `opencl_cases.small_cases` (the Oclgrind list) at f16, scheduled as the CUDA
backend schedules them: quantized matmuls (decode GEMV, batched decode at 1 to 64 rows,
prefill), batch invariance, RMSNorm, RoPE, the MoE kernels. Oracles and f16 tolerances are
in `opencl_cases.py`. Reductions run twice where the width matters: through workgroup
memory (warp size 1) and through subgroup shuffles at the device's own subgroup width.
Needs Debian mesa-vulkan-drivers + libvulkan1 and PyPI wgpu; skips naming what is missing.
"""

from __future__ import annotations

import functools

import pytest
from wgpu_runner import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

pytest.importorskip("tvm")

import opencl_cases as cases  # noqa: E402
from wgpu_runner import WGPUKernels, subgroup_size, webgpu_target  # noqa: E402

from tallow.compiler.quant import QUANT_FORMATS  # noqa: E402

# The sampler reads f32 logits in every model dtype and keeps int64 scalars, which TVM's
# WGSL code generator refuses (`test_sampler_has_no_wgsl_form`): PoCL and Oclgrind run it.
F16_CASES = [c for c in cases.small_cases() if c != "sampler"]
# Kernels whose reductions fit TVM's two-stage shuffle at a narrow subgroup (32 lanes =
# 4 subgroups of 8 on lavapipe); the others reduce over 128 to 512 threads (refused below).
SUBGROUP_CASES = ["quant_q4_0", "quant_q4k", "quant_iq4_xs", "decode_static_64"]
SWEEP = {"k": 512, "n": 60}  # N <= 64: the f16 prefill stays on SIMT cores (no wmma)
SWEEP_ROWS = {"decode": [1], "batch_decode": [1, 2, 3, 4, 7, 8, 16, 33, 64], "prefill": [1, 37]}


def _at(warp_size: int, **kw):
    return functools.partial(WGPUKernels, warp_size=warp_size, **kw)


@pytest.mark.parametrize("case", F16_CASES)
def test_f16_kernels_through_workgroup_memory(case):
    cases.small_cases(WGPUKernels, "float16")[case]()


@pytest.mark.parametrize("case", SUBGROUP_CASES)
def test_f16_kernels_through_subgroup_shuffles(case):
    """The same kernels with their cross-lane sums lowered to `subgroupShuffleDown` for the
    device's subgroup width (lavapipe: 8)."""
    cases.small_cases(_at(subgroup_size()), "float16")[case]()


def test_subgroup_lowering_is_what_runs():
    """The subgroup variant really reduces through shuffles at the device width, with no
    shuffle reaching past it, and the warp-size-1 variant through workgroup memory only."""
    import re

    from opencl_runner import gpu_scheduled
    from tvm.relax.frontend import nn

    mod, _ = cases._Projections(["q4k"], 256, 24, "float16").export_tvm(
        {"decode": {"x": nn.spec.Tensor([1, 1, 256], "float16")}}
    )
    funcs = cases.prim_funcs(gpu_scheduled(mod, "f16")[0])
    width = subgroup_size()
    shuffled = WGPUKernels(funcs, warp_size=width).source
    deltas = {
        int(d) for d in re.findall(r"subgroupShuffleDown\(\w+\[0i\], u32\((\d+)i\)\)", shuffled)
    }
    assert deltas and max(deltas) < width, deltas
    assert "subgroup" not in WGPUKernels(funcs).source


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # every output NaN, as expected
def test_tvm_webgpu_target_assumes_32_lanes():
    """TVM 0.27 overwrites a webgpu target's `thread_warp_size` with 32 whenever subgroups are
    on (`UpdateWebGPUAttrs`), so its shuffle reductions assume 32 lanes; on a narrower
    subgroup the 32-lane decode GEMV returns garbage (NaN on lavapipe). When a TVM upgrade
    honours the requested width this fails: use the target as given, drop the JSON edit."""
    import tvm

    asked = {"kind": "webgpu", "supports_subgroups": True, "thread_warp_size": 8}
    assert int(tvm.target.Target(asked).attrs["thread_warp_size"]) == 32
    assert int(webgpu_target(8).attrs["thread_warp_size"]) == 8  # the harness's edit holds
    if subgroup_size() >= 32:
        pytest.skip(f"the device's subgroup has {subgroup_size()} lanes: 32 fits")
    with pytest.raises(AssertionError, match="decode rows=1"):
        cases.check_quant_matmuls(
            ["q4k"],
            {"decode": [1]},
            "float16",
            runner=_at(32, checked=False),
            half=True,
            **cases.SMALL,
        )


def test_reductions_wider_than_the_subgroup_squared_are_refused():
    """RMSNorm's 512-thread reduction at 8 lanes would need 64 warp sums in one 8-lane
    subgroup: TVM lowers it anyway (its check reads the target's thread limit, not the
    reduction), shuffling across lanes that do not exist; the runner refuses it by name."""
    if subgroup_size() >= 32:
        pytest.skip(f"the device's subgroup has {subgroup_size()} lanes")
    with pytest.raises(NotImplementedError, match="rms_norm.*subgroupShuffleDown"):
        cases.check_rms_norms(rows=(1,), dtype="float16", runner=_at(subgroup_size()))


def test_sampler_has_no_wgsl_form():
    """The GPU sampler keeps its bisection bounds in int64 (`schedules/gpu/sampling.py`),
    and TVM's WebGPU build narrows only indices to i32: it stops there. When this fails the
    sampler builds for WebGPU: add it to F16_CASES."""
    import tvm

    with pytest.raises(tvm.error.InternalError, match="int64"):
        cases.check_sampler(runner=WGPUKernels)


def test_bf16_has_no_wgsl_type():
    """WGSL has f16 and f32 only. TVM stores a bf16 buffer as u16 and computes in f32 (its
    bf16 legalisation), and WGSL has no u16 either: a bf16 kernel (the CUDA backend's bf16
    models) cannot be run faithfully, so nothing of the bf16 path runs here."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def double(a: T.Buffer((64,), "bfloat16"), b: T.Buffer((64,), "bfloat16")):
        T.func_attr({"tirx.is_scheduled": True})
        for i in T.thread_binding(64, thread="threadIdx.x"):
            b[i] = a[i] + a[i]

    with pytest.raises(NotImplementedError, match="array<u16>"):
        WGPUKernels({"double": double})


@pytest.mark.slow
@pytest.mark.parametrize("warp", ["workgroup_memory", "subgroup"])
def test_every_quant_format_f16(warp):
    """Every format the GPU schedules take (a GPU compile refuses the others), f16, the
    decode GEMV, batched decode at 1 to 64 rows and prefill, K 512 x N 60 (no whole column
    tile)."""
    runner = WGPUKernels if warp == "workgroup_memory" else _at(subgroup_size())
    gpu_types = [t for t, f in QUANT_FORMATS.items() if f.gpu]
    cases.check_quant_matmuls(gpu_types, SWEEP_ROWS, "float16", runner=runner, half=True, **SWEEP)
