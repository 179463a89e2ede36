"""CPU levels whose prefill keeps float activations, for tests that compare logits exactly.

On x86 with AVX2, prefill rounds activations to int8 (`compiler.int8_prefill_pass`: the
AVX-512 VNNI tiles, or AVX2's column tiles; checked against numpy in test_int8_prefill and
end to end in test_gemma_real). `x86-64-v2` (no AVX2) keeps prefill and decode float, so an
exact comparison of a quantized model with its f32 twin builds that level there.
"""

from __future__ import annotations


def float_prefill_levels() -> list[str] | None:
    """`--cpu` levels for a float-prefill build on this machine (None: the native one is)."""
    from tallow.compiler.target import resolve_target
    from tallow.schedules.cpu import int8_gemv

    return ["x86-64-v2"] if int8_gemv.supported(resolve_target("cpu", "f32").tvm()) else None
