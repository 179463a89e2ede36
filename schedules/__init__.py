"""Per-target TensorIR schedules, applied once the Relax pipeline has fused the kernels.

`cpu/` (LLVM) and `gpu/` (dlight rules for CUDA and Metal) hold one package per target
family; `tir_common.py` the helpers they share. Each compile target's backend
(`compiler/backends/`) wraps its schedules in the pass the Relax pipeline runs.
"""
