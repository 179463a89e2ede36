"""Metal simdgroup matrices with f16 operands and f32 accumulators, for quantized prefill.

Our quantized matmuls dequantize the weights to the compute dtype (f16) and accumulate
f16 x f16 products in f32 (`model_defs/quant_ops.quant_matmul_te`). dlight's `MetalMatmul`
schedules a matmul onto `simdgroup_matrix` 8x8 tiles, but asks TVM 0.27's intrinsic table
(`tvm.s_tir.tensor_intrin.metal.get_simdgroup_intrin_group`) for one dtype only, f16: its
f16 multiply-accumulate does not match an f32 accumulation, tensorize raises, and dlight's
`Matmul` quietly falls back to a SIMT tiling.

Metal itself multiplies `simdgroup_half8x8` operands into `simdgroup_float8x8` accumulators
(llama.cpp's Metal matmul kernels do exactly that). So we register the three missing
intrinsics (an f32 fill exists in TVM; we add the mixed multiply-accumulate and the f32
store to threadgroup memory) and, only while `MetalMatmul` schedules one of our kernels,
hand it the intrinsic group: f16 loads of A and B, f32 fill, mixed multiply-accumulate, f32
store. The schedule (tiles, threads, shared-memory copies, the epilogue) stays dlight's.
"""

from __future__ import annotations

import contextlib

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

MMA_F16_F32 = "tallow_simdgroup_multiply_accumulate_8x8x8_f16_f32"
STORE_F32_SHARED = "tallow_simdgroup_store_8x8x8_f32_shared"
FILL_F32 = "simdgroup_fill_8x8x8_f32"  # TVM's own


def _mma_f16_f32():
    """8x8x8 C(f32) += f32(A(f16)) * f32(B(f16)) on simdgroup matrices."""
    from tvm.s_tir.tensor_intrin.metal import get_simdgroup_index

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (8, 8), "float16", scope="metal.simdgroup", offset_factor=1)
        B = T.match_buffer(b, (8, 8), "float16", scope="metal.simdgroup", offset_factor=1)
        C = T.match_buffer(c, (8, 8), "float32", scope="metal.simdgroup", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:8, 0:8], A[0:8, 0:8], B[0:8, 0:8])
            T.writes(C[0:8, 0:8])
            for i, j, k in T.grid(8, 8, 8):
                with T.sblock(""):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    C[vi, vj] = C[vi, vj] + T.Cast("float32", A[vi, vk]) * T.Cast(
                        "float32", B[vk, vj]
                    )

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        a0, a1, b0, b1, c0, c1 = T.int32(), T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        A = T.match_buffer(
            a, (8, 8), "float16", scope="metal.simdgroup", strides=[a1, a0], offset_factor=1
        )
        B = T.match_buffer(
            b, (8, 8), "float16", scope="metal.simdgroup", strides=[b1, b0], offset_factor=1
        )
        C = T.match_buffer(
            c, (8, 8), "float32", scope="metal.simdgroup", strides=[c1, c0], offset_factor=1
        )
        with T.sblock("root"):
            T.reads(C[0:8, 0:8], A[0:8, 0:8], B[0:8, 0:8])
            T.writes(C[0:8, 0:8])
            T.metal.simdgroup_multiply_accumulate(
                C.data,
                get_simdgroup_index(C, c1, 8, 8),
                A.data,
                get_simdgroup_index(A, a1, 8, 8),
                B.data,
                get_simdgroup_index(B, b1, 8, 8),
                C.data,
                get_simdgroup_index(C, c1, 8, 8),
            )

    return desc, impl


def _store_f32_shared():
    """8x8 f32 simdgroup matrix -> threadgroup memory. TVM's own f32 store passes the target
    as `tvm_access_ptr`; once StorageRewrite lets the f32 accumulator tile share memory with
    the f16 operand tiles (their lifetimes do not overlap), lowering rejects that pointer's
    element type (f32 on an f16 allocation). `address_of` an element is rewritten with the
    right type, so we pass that."""
    from tvm.s_tir.tensor_intrin.metal import get_simdgroup_index, get_simdgroup_store_intrin

    desc, _ = get_simdgroup_store_intrin("float32", "shared")

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s0, s1, d0, d1 = T.int32(), T.int32(), T.int32(), T.int32()
        A = T.match_buffer(
            a, (8, 8), "float32", align=64, scope="metal.simdgroup", strides=[s1, s0],
            offset_factor=1,
        )  # fmt: skip
        C = T.match_buffer(
            c, (8, 8), "float32", align=64, scope="shared", strides=[d1, d0], offset_factor=1
        )
        with T.sblock("root"):
            T.reads(A[0:8, 0:8])
            T.writes(C[0:8, 0:8])
            T.metal.simdgroup_store(
                A.data,
                index=get_simdgroup_index(A, s1, 8, 8),
                ptr=T.address_of(C[0, 0]),
                stride=d1,
                col=8,
                row=8,
                transpose_matrix=False,
            )

    return desc, impl


_registered: list[bool] = []


def register() -> None:
    """Register our intrinsics once per process (TVM's table refuses a second entry)."""
    if _registered:
        return
    TensorIntrin.register(MMA_F16_F32, *_mma_f16_f32())
    TensorIntrin.register(STORE_F32_SHARED, *_store_f32_shared())
    _registered.append(True)


@contextlib.contextmanager
def f32_accumulators():
    """While the block runs, `MetalMatmul` gets f16 loads and f32 accumulator intrinsics."""
    from tvm.s_tir.tensor_intrin import metal

    register()
    original = metal.get_simdgroup_intrin_group

    def group(load_scope, store_scope, dtype, trans_a=False, trans_b=False):
        names = original(load_scope, store_scope, "float16", trans_a, trans_b)
        if store_scope != "shared":  # dlight stores through threadgroup memory; else: as is
            return names
        return {**names, "init": FILL_F32, "compute": MMA_F16_F32, "store": STORE_F32_SHARED}

    metal.get_simdgroup_intrin_group = group
    try:
        yield
    finally:
        metal.get_simdgroup_intrin_group = original
