"""Our RoPE kernel (schedules/cpu/rope.py) against TVM's own, which it replaces.

The reference is the kernel TVM's KV cache builds (`llama_rope_with_position_map`); ours
computes the same angle expression once per dimension pair, so the outputs are equal bit for
bit, for q, k and the copied v.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

from tallow.compiler.target import resolve_target
from tallow.schedules.cpu import rope as cpu_rope

TARGET = resolve_target("cpu", "f32").tvm()


def _build(func):
    with TARGET:
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        return tvm.compile(mod, target=TARGET)


def _replaced(func):
    mod = cpu_rope.replace_rope_kernel(tvm.IRModule({"fused_rope": func}))
    return mod["fused_rope"]


@pytest.mark.parametrize(
    "theta,scale,head_dim,h_q,h_kv", [(1e5, 1.0, 64, 9, 3), (10000.0, 0.25, 32, 4, 4)]
)
@pytest.mark.parametrize("apply_rope", [1, 0])
def test_equals_tvm_kernel(theta, scale, head_dim, h_q, h_kv, apply_rope):
    ref = llama_rope_with_position_map(theta, scale, head_dim, h_q, h_kv, "float32", {})
    ours = _replaced(ref)
    assert 'T.sblock("rope")' in ours.script()  # recognised and replaced
    rng = np.random.default_rng(0)
    for seq in (1, 7):
        qkv = tvm.runtime.tensor(
            rng.standard_normal((seq, h_q + 2 * h_kv, head_dim)).astype(np.float32)
        )
        pos = tvm.runtime.tensor(rng.integers(0, 8000, seq).astype(np.int32))
        results = []
        for lib in (_build(ref), _build(ours)):
            outs = [tvm.runtime.empty((seq, h, head_dim), "float32") for h in (h_q, h_kv, h_kv)]
            lib["main"](qkv, pos, *outs, apply_rope)
            results.append([o.numpy() for o in outs])
        for a, b in zip(*results, strict=True):
            np.testing.assert_array_equal(a, b)


def test_scaled_rope_is_left_alone():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    ref = llama_rope_with_position_map(5e5, 1.0, 64, 8, 2, "float32", scaling)
    assert _replaced(ref).same_as(ref)


def test_model_kernel_is_recognised(tiny_model_dir, tmp_path):
    """The cache of a real model definition (tiny Qwen3: theta from its config) gets ours."""
    from tallow.compiler import phases
    from tallow.compiler.pipeline import CompileOptions, CompileState
    from tallow.compiler.progress import Progress

    options = CompileOptions(model=str(tiny_model_dir("qwen3")), output=tmp_path)
    state = CompileState(options=options, progress=Progress(quiet=True))
    for phase in (phases.read_config, phases.build_module, phases.export_functions):
        phase(state)
    mod = cpu_rope.replace_rope_kernel(state.ir_module)
    assert 'T.sblock("rope")' in mod["fused_rope"].script()
