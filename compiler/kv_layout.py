"""The KV cache's layout, chosen at compile time: `--kv-dtype` and `--page-size`.

Both are limited by TVM 0.27's paged KV cache (`relax.frontend.nn.llm.kv_cache`
`TIRPagedKVCache`, created at run time by `vm.builtin.paged_attention_kv_cache_create`),
whose append, attention, copy and compaction kernels tallow uses (on the CPU its own
attention kernels replace TVM's, `schedules/cpu/attention*.py`, sized from TVM's buffers):

* dtype: the cache takes one `dtype` for the query, the pages and the attention output
  (every kernel builder takes a single `qkv_dtype`), and its pages hold values only, with no
  room for per-block scales. A cache in f16, bf16 or f32 under another compute dtype is
  therefore built by casting q/k/v to the cache's dtype before attention and the output back
  after (`model_defs.decoder`): attention then runs in the cache's dtype. An 8-bit cache is
  refused: an fp8 (e4m3) cache would run the whole attention in fp8, q and output included
  (3 mantissa bits), and an int8 cache needs scale storage and dequantizing attention
  kernels the cache does not have.
* page size: every kernel builder takes `page_size: int = 16` and `TIRPagedKVCache` never
  passes another, so the kernels' page buffers are shaped for 16 tokens whatever page size
  the cache is created with. tallow's CPU attention kernels accept any page size, TVM's
  append and GPU kernels do not: 16 only.
"""

from __future__ import annotations

from tallow.runtime.errors import TargetError

from .backends import DTYPES

# `--kv-dtype` values that build; the compute dtype's name by default
KV_DTYPES = ("f16", "bf16", "f32")
# 8-bit caches users ask for, and why TVM 0.27's paged cache cannot hold them
_FP8 = "it takes one dtype for q, the pages and the output, so all of attention would run in fp8"
EIGHT_BIT = {
    "fp8": _FP8,
    "fp8_e4m3": _FP8,
    "int8": "its pages hold no per-block scales and its attention kernels do not dequantize",
}
PAGE_SIZES = (16,)  # TVM 0.27's cache kernels are built for pages of 16 tokens


def choose_kv_dtype(requested: str | None, compute_dtype: str, backends: list) -> str:
    """The cache's dtype (a DTYPES key): `requested` (`--kv-dtype`) or the compute dtype;
    every target must run it (bf16 is refused on Metal)."""
    kv = requested or compute_dtype
    if kv in EIGHT_BIT:
        raise TargetError(
            f"--kv-dtype {kv}: TVM 0.27's paged KV cache cannot hold it: {EIGHT_BIT[kv]} "
            f"(docs/gpu-artifacts.md#kv-cache-layout); choose from {', '.join(KV_DTYPES)}"
        )
    if kv not in KV_DTYPES:
        raise TargetError(f"--kv-dtype {kv!r} is not supported; choose from {', '.join(KV_DTYPES)}")
    assert kv in DTYPES
    for backend in backends:
        backend.check_dtype(kv)
    return kv


def check_page_size(page_size: int) -> None:
    if page_size not in PAGE_SIZES:
        raise TargetError(
            f"--page-size {page_size} is not supported; choose from "
            f"{', '.join(map(str, PAGE_SIZES))} (TVM 0.27's paged KV cache builds its append "
            "and attention kernels for pages of 16 tokens)"
        )
