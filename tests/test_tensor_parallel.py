"""Tensor parallelism (`tallow compile --tensor-parallel`, runtime/tp_runner.py).

The oracle for a TP=2 artifact is the same model compiled at TP=1: greedy tokens must be
equal and logits within float tolerance. The runners run in a subprocess, since Disco must
be preloaded before tvm is imported (this process has imported it to compile)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tallow.model_defs.config import ConfigError, DecoderConfig
from tallow.model_defs.tensor_parallel import check_degree, full_shapes, local_config
from tallow.runtime.tp_runner import shard

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 256,
}


def _config(**changes) -> DecoderConfig:
    return DecoderConfig.from_hf({**QWEN3, **changes}, qk_norm=True)


def test_shard_takes_each_workers_slice_of_every_part():
    # a fused qkv of 4 q rows, 2 k rows, 2 v rows (one column each)
    w = np.arange(8, dtype=np.float32)[:, None]
    rule = {"axis": 0, "parts": [4, 2, 2]}
    assert shard(w, rule, 2, 0)[:, 0].tolist() == [0, 1, 4, 6]
    assert shard(w, rule, 2, 1)[:, 0].tolist() == [2, 3, 5, 7]
    row_parallel = {"axis": 1, "parts": [6]}
    x = np.arange(12).reshape(2, 6)
    assert np.array_equal(np.concatenate([shard(x, row_parallel, 2, r) for r in (0, 1)], 1), x)


def test_full_shapes_undo_the_local_config():
    from tallow.compiler.weights import ParamSpec

    config = _config()
    local = local_config(config, 2)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert local.intermediate_size == 256 and local.head_dim == 64
    params = [
        ParamSpec("model.layers.0.self_attn.qkv_proj.weight", (256, 256), "float32"),
        ParamSpec("model.layers.0.self_attn.o_proj.weight", (256, 128), "float32"),
        ParamSpec("model.layers.0.mlp.down_proj.weight", (256, 256), "float32"),
        ParamSpec("model.norm.weight", (256,), "float32"),
    ]
    full, rules = full_shapes(params, config, 2)
    assert [p.shape for p in full] == [(512, 256), (256, 256), (256, 512), (256,)]
    assert rules["model.layers.0.self_attn.qkv_proj.weight"].parts == (256, 128, 128)
    assert rules["model.layers.0.self_attn.o_proj.weight"].parts == (256,)
    assert "model.norm.weight" not in rules


@pytest.mark.parametrize(
    ("degree", "changes", "quant", "says"),
    [
        (3, {}, None, "power of two"),
        (4, {}, None, "does not divide the 2 KV heads"),
        (2, {}, {"model.layers.0.self_attn.o_proj.weight": "q4k"}, "inside a block"),
    ],
)
def test_degrees_that_cannot_split_are_refused_in_one_line(degree, changes, quant, says):
    with pytest.raises(ConfigError, match=says) as e:
        check_degree(_config(**changes), degree, quant)
    assert "\n" not in str(e.value)


def test_block_aligned_quant_shards_pass():
    check_degree(_config(), 2, {"model.layers.0.self_attn.o_proj.weight": "q8_0"})


# --- compiled artifacts, compared with TP=1 -------------------------------------------------

RUN = """
import json, sys
import numpy as np
from tallow.runtime.model_runner import TVMModelRunner
from tallow.runtime.tp_runner import TPModelRunner
one_path, tp_path = sys.argv[1], sys.argv[2]
tp = TPModelRunner(tp_path)
one = TVMModelRunner(one_path)
prompt = [5, 17, 33, 64, 100, 7, 9, 250, 3]
out = {}
for name, r in (("one", one), ("tp", tp)):
    r.add_sequence(0)
    logits = [np.asarray(r.forward([(0, prompt)]))[0]]
    tokens = []
    for _ in range(10):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(np.asarray(r.forward([(0, [tokens[-1]])]))[0])
    # a batch of two sequences through batch_prefill and batch_decode
    r.add_sequence(1)
    r.add_sequence(2)
    b = np.asarray(r.forward([(1, prompt[:4]), (2, prompt[3:])]))
    d = np.asarray(r.forward([(1, [9]), (2, [11])]))
    out[name] = (tokens, np.concatenate([np.stack(logits), b, d]))
refused = []
for make in (lambda: TPModelRunner(tp_path, workers=1), lambda: TVMModelRunner(tp_path)):
    try:
        make()
    except Exception as e:
        refused.append(str(e))
# the serving engine over each artifact: three prompts batched, greedy
from tallow.runtime.engine_factory import EngineOptions, build_engine
from tallow.runtime.sampling_params import SamplingParams
prompts = [prompt, prompt[2:7], [40, 41, 42]]
engine_tokens = {}
for name, path in (("one", one_path), ("tp", tp_path)):
    engine = build_engine(path, EngineOptions(kv_cache_mem_mb=8, prefix_cache=False))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, greedy)
    engine_tokens[name] = [
        [t for o in outs for d in o.outputs for t in d.token_ids] for outs in results
    ]
    if name == "tp":
        engine.runner.close()
diff = float(np.abs(out["one"][1] - out["tp"][1]).max())
scale = float(np.abs(out["one"][1]).max())
free = [one.num_free_pages(), tp.num_free_pages()]
print(json.dumps({"one": out["one"][0], "tp": out["tp"][0], "diff": diff, "scale": scale,
                  "refused": refused, "engine": engine_tokens, "free": free}))
tp.close()
"""


def _compare(one, tp) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RUN), str(one), str(tp)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _compile(src, out, degree: int, quant: str | None = None):
    from tallow.compiler.pipeline import CompileOptions, compile_model

    opts = CompileOptions(
        model=str(src), dtype="f32", quant=quant, output=out, quiet=True, tensor_parallel=degree
    )
    return compile_model(opts)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "quant"),
    [
        ("llama", None),
        ("qwen3_wide", None),
        ("qwen3_wide", "q8_0"),
        # the other families of the shared decoder: qkv bias, sandwich norms with windows and
        # soft caps, Phi-3's fused checkpoint weights
        ("qwen2", None),
        ("gemma2", None),
        ("phi3", None),
    ],
)
def test_tp2_matches_tp1(tiny_model_dir, tmp_path, model, quant):
    src = tiny_model_dir(model)
    one, tp = _compile(src, tmp_path, 1, quant), _compile(src, tmp_path, 2, quant)
    from tallow.runtime.manifest import Manifest

    manifest = Manifest.read(tp)
    assert manifest.tensor_parallel_degree == 2 and tp.name.endswith("-tp2")
    got = _compare(one, tp)
    print(f"{model} {quant}: tokens {got['tp']}, max logit difference {got['diff']:.3g}")
    assert got["tp"] == got["one"]
    # Float weights: only the summation order differs. q8_0: the CPU decode kernels round
    # activations to int8 with one step per row (compiler/int8_decode_pass.py), and a worker's
    # row is half of o_proj's / down_proj's input, so its step differs (prefill, with float
    # activations, agrees to 7e-6 there).
    tolerance = 1e-4 if quant is None else 3e-2
    assert got["diff"] <= tolerance * max(1.0, got["scale"]), got
    assert got["free"][0] == got["free"][1]
    assert got["engine"]["tp"] == got["engine"]["one"]
    assert [len(t) for t in got["engine"]["tp"]] == [6, 6, 6]
    # a mismatched worker count, and the one-worker runner, are refused in one line each
    assert len(got["refused"]) == 2
    assert all("compiled for 2 tensor-parallel worker(s)" in e for e in got["refused"])
    assert all("\n" not in e for e in got["refused"])


def test_compile_refuses_a_degree_that_is_no_power_of_two_before_tvm(tmp_path):
    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.errors import TallowError

    with pytest.raises(TallowError, match="--tensor-parallel 3: must be a power of two"):
        compile_model(CompileOptions(model=str(tmp_path), output=tmp_path, tensor_parallel=3))


# --- ProcessSession workers (the CUDA path's session), on the CPU ---------------------------

LOAD_SHARDS = """
import json, os, sys
from pathlib import Path
import numpy as np
from tallow.runtime.disco_runtime import disco
d = disco()
from tallow.runtime.artifact import read_weights
from tallow.runtime.manifest import Manifest
from tallow.runtime.tp_runner import load_shards, shard, start_workers
folder = Path(sys.argv[1])
manifest = Manifest.read(folder)
library = manifest.libraries[0]
sess = start_workers(d, 2)
params = load_shards(sess, folder, library.file)
whole = read_weights(folder, manifest, library)
rules = manifest.tensor_parallel.shards
infos = manifest.params_for(library)
worst, split, shapes = 0.0, 0, []
for rank in range(2):
    got = params.debug_get_from_remote(rank)
    assert len(got) == len(infos)
    for info, w, g in zip(infos, whole, got):
        rule = rules.get(info.name)
        want = shard(w, rule, 2, rank) if rule else w
        g = g.numpy()
        shapes.append(list(g.shape) == list(want.shape))
        if g.shape == want.shape:
            worst = max(worst, float(np.abs(g - want).max()))
        split += rule is not None
sess.shutdown()
print(json.dumps({"worst": worst, "split": split, "shapes": all(shapes), "n": len(infos)}))
"""


@pytest.mark.slow
def test_process_session_workers_load_their_own_weight_slices(tiny_model_dir, tmp_path):
    """The CUDA path's session, run on the CPU: two `tp_worker` workers (worker 1 a separate
    process) each read their slices from the artifact's files; compared with slicing the
    whole weights here. No forward: the CPU collective needs threads of one process."""
    tp = _compile(tiny_model_dir("llama"), tmp_path, 2)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LOAD_SHARDS), str(tp)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["shapes"] and got["worst"] == 0.0, got
    assert got["split"] > 0 and got["split"] < 2 * got["n"], got  # some split, some whole
