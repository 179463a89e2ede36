"""GPU-scheduled kernels run on the CPU: scheduled as for a CUDA artifact, emitted as OpenCL C
and launched with pyopencl on PoCL (`tests/opencl_runner.py`; docs/gpu-artifacts.md).

The cases live in `opencl_cases.py`, shared with the Oclgrind test (`test_oclgrind.py`),
which runs smaller instances of them with every memory access checked; here they run at the
shapes that exercise the schedules' tiles and tails. Oracles: the `gguf` dequantizers + numpy
for the quantized matmuls (decode, batched decode and prefill shapes, tails that fill no
whole tile), numpy for RMSNorm, RoPE and the MoE kernels, the host sampler's numpy code for
the GPU token sampler. Needs Debian pocl-opencl-icd + ocl-icd-libopencl1 and PyPI pyopencl;
skips naming what is missing.
"""

from __future__ import annotations

import pytest
from opencl_runner import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

pytest.importorskip("tvm")

import opencl_cases as cases  # noqa: E402

from tallow.compiler.quant import QUANT_FORMATS  # noqa: E402

# every format the GPU schedules take (the others: a GPU compile refuses them,
# test_lowbit_quants / test_iquants_grid)
SLOW_TYPES = [t for t, f in QUANT_FORMATS.items() if f.gpu and t not in cases.FAST_TYPES]


def test_quant_matmuls_on_opencl():
    cases.check_quant_matmuls(cases.FAST_TYPES)


def test_static_row_decode_on_opencl():
    """`QuantDecodeGEMV` at its largest static row count: 64 rows of register accumulators per
    lane, summed across the lanes row by row (the lanes bound innermost, not the rows)."""
    cases.check_quant_matmuls(["q4k"], {"decode": [64]}, leading={"decode": [64, 1]})


def test_f16_decode_on_opencl():
    """The f16 `decode` (`QuantDecodeGEMV`) and `batch_decode` (dlight `LowBatchGEMV`) kernels
    with f16 activations: PoCL has no cl_khr_fp16, but these kernels only load the f16 inputs
    and convert them to float (`vload_half`, core OpenCL; `opencl_runner.py`), then decode and
    accumulate in f32, so their f16 numerics run as they would on a GPU. (dlight's prefill
    kernels keep f16 values in buffers of their own, which the runner refuses on PoCL.)"""
    cases.check_quant_matmuls(["q4k"], {"decode": [1], "batch_decode": [1, 3, 16]}, "float16")


@pytest.mark.slow
def test_quant_matmuls_on_opencl_every_format():
    cases.check_quant_matmuls(SLOW_TYPES)


@pytest.mark.parametrize(
    ("target", "dtype"),
    [("cuda", "float32"), ("cuda", "float16"), ("metal", "float32"), ("metal", "float16")],
)
def test_batch_decode_rows_do_not_depend_on_the_batch(target, dtype):
    """`--deterministic` on a GPU library (docs/cpu-kernels.md#deterministic-mode): `batch_decode`'s
    kernels as `target` schedules them (dlight `LowBatchGEMV` for the matmuls: 4-row tiles on
    `blockIdx.y`, K split across the threads; `Reduction` for RMSNorm) give row r of a batch
    of B, for B from 1 to 17, the bits of row r alone. Run as OpenCL C: CUDA's warp-shuffle
    and Metal's simdgroup reductions lower to shared memory here (`opencl_runner.py`)."""
    cases.check_batch_invariance(target, dtype)


def test_rms_norms_on_opencl():
    cases.check_rms_norms()  # 576: SmolLM2's width, not a power of two


@pytest.mark.parametrize("vocab", [1003, pytest.param(4096, marks=pytest.mark.slow)])
def test_gpu_sampler_on_opencl(vocab):
    cases.check_sampler(vocab)


def test_rope_table_on_opencl():
    """RoPE from a frequency table in the graph, 48 of 64 dimensions rotated."""
    cases.check_rope()


@pytest.mark.parametrize("qtype", ["q4k", "q8_0"])
def test_moe_kernels_on_opencl(qtype):
    """Route, group, the grouped matmul (gate / up's gather form) and combine, chained."""
    cases.check_moe(qtype, tokens=9)


def test_paged_kv_attention_on_opencl():
    """TVM's paged-KV attention kernels (decode, prefill over pages, ragged prefill) lowered
    for OpenCL, float32, GQA 4 / 2 heads, sequences over 1 to 4 pages."""
    cases.check_paged_kv_attention(kv_lens=(1, 16, 17, 40, 64), q_lens=(1, 16, 5, 33, 64))


@pytest.mark.xfail(reason="TVM's merge_state_inplace races on S (opencl_paged_kv.py)")
def test_tvm_merge_state_on_opencl():
    cases.check_merge_state(kernel="merge")


@pytest.mark.parametrize(("n", "heads", "dims"), [(3, 4, 64), (2, 6, 80), (1, 8, 256)])
def test_merge_state_on_opencl(n, heads, dims):
    """tallow's merge (schedules/gpu/merge_state.py), which GPU artifacts run in place of
    TVM's: right where TVM's is wrong (4 x 64), with idle heads and lanes, and at Gemma's
    256 dims (two warps of TVM's kernel)."""
    cases.check_merge_state(n=n, h_q=heads, d=dims)
