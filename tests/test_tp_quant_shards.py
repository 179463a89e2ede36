"""Every registered block format, sharded for tensor parallelism.

The oracle is `gguf`'s own dequantizer (llama.cpp's Python reference): for each format, the
slice a worker is given of a quantized weight (the compiler's rule, `full_shapes`, applied by
the runtime's `shard`) must dequantize to exactly the matching slice of the whole weight's
dequantization. The slices are cut in float space here, independently of the byte rules.
A degree that would cut a row-parallel weight inside a block is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from quant_blocks import weight_blocks

from tallow.compiler.quant import QUANT_FORMATS
from tallow.compiler.weights import ParamSpec
from tallow.model_defs.config import ConfigError, DecoderConfig
from tallow.model_defs.quant_ops import row_bytes
from tallow.model_defs.tensor_parallel import check_degree, full_shapes, local_config
from tallow.runtime.tp_runner import shard

# 8 q heads and 4 KV heads of 64: o_proj has 512 inputs, down_proj 1024, each expert's
# down projection 512; so at TP=2 every share is whole 256-weight blocks, at TP=4 o_proj's
# 128 inputs per worker end inside a 256-weight block.
CONFIG = DecoderConfig.from_hf(
    {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
    qk_norm=True,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    moe_layers=[1],
    shared_expert_intermediate_size=512,
)
HIDDEN = CONFIG.hidden_size
Q = CONFIG.num_attention_heads * CONFIG.head_dim
KV = CONFIG.num_key_value_heads * CONFIG.head_dim
E, W, S = CONFIG.num_experts, CONFIG.moe_intermediate_size, CONFIG.shared_expert_intermediate_size
INTER = CONFIG.intermediate_size

# name -> (float rows, float cols, how a worker's float slice is cut: ("rows", parts) takes
# slice r of each consecutive run of rows; ("cols",) slice r of the columns)
WEIGHTS = {
    "model.layers.0.self_attn.qkv_proj.weight": (Q + 2 * KV, HIDDEN, ("rows", [Q, KV, KV])),
    "model.layers.0.self_attn.o_proj.weight": (HIDDEN, Q, ("cols",)),
    "model.layers.0.mlp.gate_up_proj.weight": (2 * INTER, HIDDEN, ("rows", [INTER, INTER])),
    "model.layers.0.mlp.down_proj.weight": (HIDDEN, INTER, ("cols",)),
    "model.layers.1.mlp.experts.gate_proj": (E * W, HIDDEN, ("rows", [W] * E)),
    "model.layers.1.mlp.experts.up_proj": (E * W, HIDDEN, ("rows", [W] * E)),
    "model.layers.1.mlp.experts.down_proj": (E * HIDDEN, W, ("cols",)),
    "model.layers.1.mlp.shared_expert.gate_up_proj.weight": (2 * S, HIDDEN, ("rows", [S, S])),
    "model.layers.1.mlp.shared_expert.down_proj.weight": (HIDDEN, S, ("cols",)),
}


def _float_slice(x: np.ndarray, cut: tuple, n: int, rank: int) -> np.ndarray:
    if cut[0] == "cols":
        step = x.shape[1] // n
        return x[:, rank * step : (rank + 1) * step]
    pieces, start = [], 0
    for size in cut[1]:
        step = size // n
        pieces.append(x[start + rank * step : start + (rank + 1) * step])
        start += size
    return np.concatenate(pieces)


def _local_specs(qtype: str, n: int) -> list[ParamSpec]:
    """The parameters as the compiler sees them: one worker's shapes, in blocks."""
    local = local_config(CONFIG, n)
    assert (local.moe_intermediate_size, local.shared_expert_intermediate_size) == (W // n, S // n)
    specs = []
    for name, (rows, cols, cut) in WEIGHTS.items():
        if cut[0] == "cols":
            shape = (rows, row_bytes(qtype, cols // n))
        else:
            shape = (rows // n, row_bytes(qtype, cols))
        specs.append(ParamSpec(name, shape, "uint8"))
    return specs


@pytest.mark.parametrize("qtype", list(QUANT_FORMATS))
@pytest.mark.parametrize("n", [2, 4])
def test_each_workers_blocks_dequantize_to_its_slice_of_the_whole(qtype, n):
    fmt = QUANT_FORMATS[qtype]
    quant = dict.fromkeys(WEIGHTS, qtype)
    if n == 4 and fmt.block_size == 256:
        # o_proj: 512 inputs / 4 = 128 per worker, half a block
        with pytest.raises(ConfigError, match="o_proj.*inside a block") as e:
            check_degree(CONFIG, n, quant)
        assert "\n" not in str(e.value)
        return
    check_degree(CONFIG, n, quant)
    full, rules = full_shapes(_local_specs(qtype, n), CONFIG, n)
    ggml = GGMLQuantizationType(fmt.ggml_type)
    rng = np.random.default_rng(abs(hash((qtype, n))) % 2**32)
    for spec in full:
        rows, cols, cut = WEIGHTS[spec.name]
        blocks = weight_blocks(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
        assert blocks.shape == spec.shape, spec.name  # the artifact stores the whole weight
        whole = dequantize(blocks, ggml)
        rule = rules[spec.name].to_dict()
        for rank in range(n):
            mine = dequantize(shard(blocks, rule, n, rank), ggml)
            expected = _float_slice(whole, cut, n, rank)
            assert np.array_equal(mine, expected), (spec.name, rank)


def test_a_compile_that_would_cut_inside_a_block_is_refused_in_one_line(tiny_model_dir, tmp_path):
    """qwen3_wide's o_proj has 256 inputs: 128 per worker at TP=2, half a q4k block."""
    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.errors import TallowError

    src = tiny_model_dir("qwen3_wide")
    opts = CompileOptions(
        model=str(src), dtype="f32", quant="q4k", output=tmp_path, quiet=True, tensor_parallel=2
    )
    with pytest.raises(TallowError, match=r"--tensor-parallel 2: .*o_proj.*\(q4k\).*block") as e:
        compile_model(opts)
    assert "\n" not in str(e.value)


def test_a_fused_projection_of_two_formats_is_split_run_by_run():
    """Q4_K_M's q/k in q4k and v in q6k: the fused qkv is two parameters (runs), each cut by
    its own parts; worker r's runs must dequantize to its q, k and v rows of the whole."""
    n, name = 2, "model.layers.0.self_attn.qkv_proj"
    types = ("q4k", "q4k", "q6k")
    check_degree(CONFIG, n, {f"{name}.weight": types})
    local = [
        ParamSpec(f"{name}.runs.0.weight", ((Q + KV) // n, row_bytes("q4k", HIDDEN)), "uint8"),
        ParamSpec(f"{name}.runs.1.weight", (KV // n, row_bytes("q6k", HIDDEN)), "uint8"),
    ]
    full, rules = full_shapes(local, CONFIG, n)
    assert [rules[p.name].parts for p in full] == [(Q, KV), (KV,)]
    x = np.random.default_rng(1).standard_normal((Q + 2 * KV, HIDDEN)).astype(np.float32)
    runs = [weight_blocks(x[: Q + KV], "q4k"), weight_blocks(x[Q + KV :], "q6k")]
    assert [r.shape for r in runs] == [p.shape for p in full]
    ggml = [GGMLQuantizationType(QUANT_FORMATS[t].ggml_type) for t in ("q4k", "q6k")]
    whole = np.concatenate([dequantize(r, g) for r, g in zip(runs, ggml, strict=True)])
    for rank in range(n):
        mine = [
            dequantize(shard(r, rules[p.name].to_dict(), n, rank), g)
            for r, p, g in zip(runs, full, ggml, strict=True)
        ]
        expected = _float_slice(whole, ("rows", [Q, KV, KV]), n, rank)
        assert np.array_equal(np.concatenate(mine), expected)
