"""GPU (CUDA, Metal) schedules: TVM's dlight rules, applied one kernel at a time so the
compiler can report which rule each kernel got.

Rule order matters (first match wins), as in MLC-LLM:

* `Matmul` – prefill-sized matmuls. On CUDA sm_70+ with fp16 inputs and every static extent
  above 64 it tries `MatmulTensorization` (wmma tensor cores); on Metal `MetalMatmul`
  (simdgroup matrices). Otherwise a SIMT tiling.
* `QuantPrefillMatmul` (ours, `quant_prefill.py`) – `Matmul` for matmuls over GGUF blocks,
  shaped to stay within the registers (CUDA) and on simdgroup matrices (Metal).
* `GEMV` / `LowBatchGEMV` – decode: one (or a few) rows times a weight matrix; memory
  bound, tensor cores would not help.
* `QuantDecodeGEMV` (ours, `quant_gemv.py`) – decode matmuls over GGUF blocks with a static
  row count, which dlight's GEMV cannot analyse and LowBatchGEMV declines.
* `Reduction` / `GeneralReduction` – RMSNorm, softmax and the like.
* `Fallback` – everything else (elementwise) gets a plain thread binding.

The paged-attention kernels of TVM's KV cache come already scheduled for the GPU and are
left alone ("prescheduled").

Kernels called from the decode functions (`decode`, `batch_decode`) try the matrix-vector
rules first: there `Matmul` would tile a 1–64-row product like a prefill GEMM, reading every
weight tile once per row block. `LowBatchGEMV` dequantizes each weight chunk into registers
once per tile of 4 batch rows (read from its TIR): one pass over the weights up to batch 4,
ceil(batch / 4) passes above.

A kernel the `Matmul` rule took but could not put on tensor cores is never silent: it is
listed with the reason, and a warning is logged, because on a tensor-core GPU such a kernel
is usually the slowest in prefill.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
from collections import Counter

import tvm
from tvm import tirx
from tvm.s_tir import dlight as dl

log = logging.getLogger(__name__)

# Calls that only appear when a block was tensorized onto matrix units.
_TENSOR_CORE_CALLS = re.compile(r"mma_sync|ptx_mma|simdgroup_multiply_accumulate")


def _import_tensor_intrinsics() -> None:
    """Import `tvm.s_tir.tensor_intrin` (wmma / simdgroup intrinsics) in ~10 s, not ~100 s.

    The dlight tensor-core rules import it on first use; it parses ~260 TVMScript functions
    and the parser calls `inspect.stack()` for each. With TVM's ~2000 modules loaded,
    `inspect.getmodule` rescans all of `sys.modules` for every frame whose file is not a
    module (the `<frozen importlib._bootstrap>` frames of the import itself). We memoise it
    per frame file for the duration of this one import; nothing else is changed.
    """
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    original, cache = inspect.getmodule, {}

    def getmodule(obj, _filename=None):
        code = getattr(obj, "f_code", None)
        if code is None:
            return original(obj, _filename)
        key = (code.co_filename, _filename)
        if key not in cache:
            cache[key] = original(obj, _filename)
        return cache[key]

    inspect.getmodule = getmodule
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401
    finally:
        inspect.getmodule = original


# Rules that tile matmuls for prefill (tensor cores where the target has them).
MATMUL_RULES = ("QuantPrefillMatmul", "Matmul")

# Relax functions whose kernels are matrix-vector products (1 to 64 rows), and the
# static-row batch decodes (`model_defs/decoder.static_decode_name`: `batch_decode_b8`).
DECODE_FUNCTIONS = ("decode", "batch_decode")
STATIC_DECODE = re.compile(r"batch_decode_b\d+")


def is_decode_function(name: str) -> bool:
    return name in DECODE_FUNCTIONS or STATIC_DECODE.fullmatch(name) is not None


def _rules(decode: bool):
    from .quant_gemv import QuantDecodeGEMV
    from .quant_prefill import QuantPrefillMatmul

    matmul = [("QuantPrefillMatmul", QuantPrefillMatmul()), ("Matmul", dl.gpu.Matmul())]
    gemv = [
        ("QuantDecodeGEMV", QuantDecodeGEMV(unroll=None, vector_x=True)),
        ("LowBatchGEMV", dl.gpu.LowBatchGEMV()),
        ("GEMV", dl.gpu.GEMV()),
    ]
    rest = [
        ("Reduction", dl.gpu.Reduction()),
        ("GeneralReduction", dl.gpu.GeneralReduction()),
        ("Fallback", dl.gpu.Fallback()),
    ]
    return gemv + matmul + rest if decode else matmul + gemv + rest


def is_quant_matmul(func: tirx.PrimFunc) -> bool:
    """A matmul over GGUF blocks: `model_defs/quant_ops.quant_matmul_te`'s two blocks."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    try:
        sch.get_sblock("dequantize")
        sch.get_sblock("matmul")
    except Exception:  # noqa: BLE001 - TVM raises its own error type for a missing block
        return False
    return True


def _decode_kernels(mod: tvm.IRModule) -> dict[str, set[str]]:
    """Decode function name -> names of the PrimFuncs it calls."""
    from tvm import relax

    return {
        gv.name_hint: {g.name_hint for g in relax.analysis.all_global_vars(func)}
        for gv, func in mod.functions_items()
        if isinstance(func, relax.Function) and is_decode_function(gv.name_hint)
    }


def _family(name: str) -> str:
    """`fused_NT_matmul1_add2` -> `fused_NT_matmul_add`: one family per kernel shape class."""
    return re.sub(r"\d+(?=_|$)", "", name)


def _no_tensor_core_reason(func: tirx.PrimFunc, target) -> str:
    """Why dlight's Matmul rule kept this kernel on SIMT cores (mirrors its own checks)."""
    # (The 0.27 Python PrimFunc exposes no buffer_map: read the buffers off its script.)
    buffers = re.findall(r'T\.Buffer\(\((.*?)\), "(\w+)"\)', func.script())
    dtypes = {dtype for _, dtype in buffers}
    if target.kind.name == "metal" and {"float16", "float32"} <= dtypes:
        if is_quant_matmul(func):  # simdgroup_f32.py's intrinsics were tried and did not fit
            return "f16 x f16 -> f32 simdgroup tensorization did not match"
        return (
            "f16 operands with an f32 accumulator: TVM's Metal simdgroup intrinsics take one "
            "dtype for both (ours, simdgroup_f32.py, are used for quantized matmuls only)"
        )
    if "float16" not in dtypes:
        return f"dtype {'/'.join(sorted(dtypes))}: dlight tensorizes fp16 (and int8) only"
    if func.attrs and "dlight.do_not_tensorize" in func.attrs:
        return "marked dlight.do_not_tensorize"
    shapes = [int(d) for dims, _ in buffers for d in re.findall(r"(?<![\w.])\d+", dims)]
    if any(0 < d <= 64 for d in shapes):
        return "a static extent <= 64 (below dlight's tensorization threshold)"
    return "tensorization rule did not match"


def schedule_module(
    mod: tvm.IRModule, target, report: dict | None = None, tensor_cores: bool = False
) -> tvm.IRModule:
    """Schedule every unscheduled PrimFunc; fill `report` with what each kernel got.

    `tensor_cores`: the target has matrix units (the backend's `has_tensor_cores`), so a
    matmul the Matmul rule kept on SIMT cores is reported with the reason."""
    _import_tensor_intrinsics()
    by_function = _decode_kernels(mod)
    decode_kernels = set().union(*by_function.values())
    kernels: dict[str, str] = {}
    quant: dict[str, dict] = {}
    families: dict[str, Counter] = {}
    tensor_core, fallbacks, errors = [], [], {}
    updated = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        name = gv.name_hint
        if func.attrs and "tirx.is_scheduled" in func.attrs:
            kernels[name] = "prescheduled"
            families.setdefault(_family(name), Counter())["prescheduled"] += 1
            continue
        chosen = None
        role = "decode" if name in decode_kernels else "prefill"
        for rule_name, rule in _rules(role == "decode"):
            try:
                space = rule.apply(func, target, False)
            except Exception as e:  # a rule that half-matches raises; try the next one
                errors[name] = f"{rule_name}: {type(e).__name__}: {str(e)[:200]}"
                continue
            if space is None:
                continue
            sch = space[0] if isinstance(space, list) else space
            updated[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
            chosen = rule_name
            break
        kernels[name] = chosen or "unscheduled"
        if is_quant_matmul(func):
            quant[name] = {"rule": kernels[name], "role": role}
        families.setdefault(_family(name), Counter())[kernels[name]] += 1
        if chosen in MATMUL_RULES:
            if _TENSOR_CORE_CALLS.search(updated[gv].script()):
                tensor_core.append(name)
            elif tensor_cores:
                reason = _no_tensor_core_reason(func, target)
                fallbacks.append({"kernel": name, "reason": reason})
                # INFO: the build report lists every fallback (`tensor_core` in the
                # manifest's library details); a default CUDA compile has 24-30 of them (decode
                # GEMVs and small shapes), nothing the user can act on.
                log.info("matmul kernel %s is not on tensor cores: %s", name, reason)
    for gv, func in updated.items():
        mod[gv] = func
    unscheduled = [k for k, r in kernels.items() if r == "unscheduled"]
    if unscheduled:
        raise RuntimeError(f"no GPU schedule rule matched kernels {unscheduled}: {errors}")
    if report is not None:
        report["rules"] = dict(Counter(kernels.values()))
        report["kernels"] = dict(sorted(kernels.items()))
        # Every matmul over GGUF blocks, with its rule and whether decode or prefill calls it.
        report["quant_matmuls"] = dict(sorted(quant.items()))
        # The static-row batch decodes' quantized matmuls and their rules: the evidence that
        # each reads its weights once (QuantDecodeGEMV) at every bucket's row count.
        static = {
            fn: {k: kernels[k] for k in sorted(called) if k in quant}
            for fn, called in sorted(by_function.items())
            if STATIC_DECODE.fullmatch(fn)
        }
        if static:
            report["static_decode"] = static
        report["families"] = {f: dict(c) for f, c in sorted(families.items())}
        report["tensor_core"] = {
            "target_has_tensor_cores": tensor_cores,
            "tensorized_kernels": sorted(tensor_core),
            "matmul_kernels_without_tensor_cores": fallbacks,
        }
    return mod
