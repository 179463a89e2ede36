"""CPU levels whose prefill keeps float activations, for tests that compare logits exactly.

With AVX-512 VNNI, prefill rounds activations to int8 (`compiler.int8_prefill_pass`, checked
against numpy in test_int8_prefill and end to end in test_gemma_real); the AVX2 level
(`x86-64-v3`) keeps them float, so an exact comparison builds that level there.
"""

from __future__ import annotations


def float_prefill_levels() -> list[str] | None:
    """`--cpu` levels for a float-prefill build on this machine (None: the native one is)."""
    from tallow.compiler.target import resolve_target
    from tallow.schedules.cpu import int8_vnni

    return ["x86-64-v3"] if int8_vnni.supported(resolve_target("cpu", "f32").tvm()) else None
