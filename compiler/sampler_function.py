"""Adds `sample_tokens` to the exported module: the token sampler, compiled into the artifact.

    sample_tokens(logits [n, vocab] f32, controls [n, 5] f32) -> token ids [n] i32

with the controls of a row: temperature, top_k, top_p, min_p and its uniform draw.

The runtime calls it on the logits a forward left on the device, so only `n` token ids come
back to the host (on a GPU, instead of n x vocab floats). The kernel is the target's (its
backend's `sampler_kernels`: `schedules/cpu/sampling.py`, `schedules/gpu/sampling.py`),
scheduled by hand; its two scratch outputs are planned like any other intermediate.
"""

from __future__ import annotations

from tallow.runtime.model_runner_protocol import CONTROL_COLUMNS, SAMPLER_FUNCTION

from .backends.base import TargetBackend

__all__ = ["SAMPLER_FUNCTION", "add_sampler_function"]


def add_sampler_function(mod, vocab_size: int, backend: TargetBackend):
    """`mod` with `sample_tokens` added, its kernel the one `backend` provides."""
    from tvm import relax, tirx

    kernels = backend.sampler_kernels()
    kernel = kernels.sample_kernel(vocab_size, vocab_size)
    width = kernels.workspace_width(vocab_size)

    n = tirx.Var("n", "int64")

    def tensor(name: str, shape, dtype: str):
        return relax.Var(name, relax.TensorType(shape, dtype))

    logits = tensor("logits", (n, vocab_size), "float32")
    controls = tensor("controls", (n, len(CONTROL_COLUMNS)), "float32")
    bb = relax.BlockBuilder(mod)
    with bb.function(SAMPLER_FUNCTION, [logits, controls]):
        gv = bb.add_func(kernel, "sample_tokens_kernel")
        out = bb.emit(
            relax.call_tir(
                gv,
                [logits, controls],
                out_ty=[
                    relax.TensorType((n,), "int32"),
                    relax.TensorType((n, width), "float32"),  # exp(y - max y)
                    relax.TensorType((n, width), "int32"),  # order-preserving keys
                ],
            )
        )
        tokens = bb.emit(relax.TupleGetItem(out, 0))
        bb.emit_func_output(tokens)
    return bb.get()
