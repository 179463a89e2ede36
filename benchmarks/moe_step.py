"""A tiny mixture-of-experts model on the CPU: one decode step broken down by kernel, then
decode and prefill tok/s.

    PYTHONPATH=... .venv/bin/python benchmarks/moe_step.py --out /tmp/moe-bench
    .venv/bin/python benchmarks/moe_step.py --out /tmp/moe-bench-old --reuse-model /tmp/moe-bench

The model has Qwen3-30B-A3B's proportions scaled down (`--hidden`, default 512: expert width
0.375 x hidden, 16 experts, 2 per token, 4 layers, GQA 8/2 x 64, vocab 4096) and random
weights (numpy, written as a Hugging Face folder, `--quant` optional). The breakdown comes
from timing every call of the Relax VM (`set_instrument`; TVM 0.27's VM has no
`profile=True`) on `batch_decode` of `--batch` sequences; the MoE kernels are marked.
Run the same script with another tallow checkout on PYTHONPATH (say one from before
grouped experts) for a side-by-side figure: `--reuse-model` shares the weights, and
`--artifact A --baseline B` then measures the two artifacts in one process, taking turns
(the runtime reads both). On a shared machine, `--cpu-time` with TVM_NUM_THREADS=1 times
with this process's CPU time instead of the wall clock.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def config(hidden: int, layers: int, experts: int, top_k: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 4096,
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "moe_intermediate_size": hidden * 3 // 8,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 256),
        "head_dim": 64,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_model(folder: Path, cfg: dict) -> None:
    """config.json, random safetensors weights and a small byte-level BPE tokenizer."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    h, w, v = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    q, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(
            np.float32
        )

    t = {"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h)}
    t["model.norm.weight"] = np.ones(h, np.float32)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t[f"{p}.self_attn.q_proj.weight"] = rand(q * d, h)
        t[f"{p}.self_attn.k_proj.weight"] = rand(kv * d, h)
        t[f"{p}.self_attn.v_proj.weight"] = rand(kv * d, h)
        t[f"{p}.self_attn.o_proj.weight"] = rand(h, q * d)
        t[f"{p}.self_attn.q_norm.weight"] = np.ones(d, np.float32)
        t[f"{p}.self_attn.k_norm.weight"] = np.ones(d, np.float32)
        t[f"{p}.input_layernorm.weight"] = np.ones(h, np.float32)
        t[f"{p}.post_attention_layernorm.weight"] = np.ones(h, np.float32)
        t[f"{p}.mlp.gate.weight"] = rand(cfg["num_experts"], h)
        for e in range(cfg["num_experts"]):
            for name, shape in (("gate", (w, h)), ("up", (w, h)), ("down", (h, w))):
                t[f"{p}.mlp.experts.{e}.{name}_proj.weight"] = rand(*shape)
    save_file(t, str(folder / "model.safetensors"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False})
    )


MOE_KERNEL = re.compile(r"moe_|route|group")
# what every figure is timed with; `--cpu-time` makes it this process's CPU time, which with
# TVM_NUM_THREADS=1 (the kernels on the calling thread) other processes on a shared machine
# barely move, unlike wall time
clock = time.perf_counter


def kernel_breakdown(runner, batch: int, rounds: int) -> list[tuple[str, float, int]]:
    """(kernel, µs per step, calls per step) of `batch_decode`: a second VM on the
    same library times every call it makes (`set_instrument`, before and after each call;
    the CPU kernels run synchronously, the callback adds a few µs to each)."""
    import tvm
    import tvm_ffi
    from tvm.runtime import vm as tvm_vm

    from tallow.runtime.model_runner import _library_path

    lib = tvm_ffi.load_module(str(_library_path(runner.folder, runner.library)))
    vm = tvm_vm.VirtualMachine(lib, runner.device)
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    started: list[float] = []

    def instrument(func, symbol, before, ret, *args):
        if before:
            started.append(clock())
        else:
            name = str(symbol)
            totals[name] += (clock() - started.pop()) * 1e6 / rounds
            calls[name] += 1
        return 0  # VMInstrumentReturnKind.NO_OP

    ids = list(range(100, 100 + batch))
    for s in ids:
        runner.add_sequence(s)
    runner.forward([(s, [5, 6, 7, 8]) for s in ids])
    shape = tvm.runtime.ShapeTuple
    decode = vm["batch_decode"]
    for r in range(rounds + 1):
        if r == 1:  # the first step warms up, untimed
            vm.set_instrument(instrument)
            totals.clear()
            calls.clear()
        tokens = np.full(batch, 9, np.int32)
        embeds = runner._funcs["embed"](tvm.runtime.tensor(tokens, runner.device), runner.params)
        embeds = embeds._create_view((batch, 1, runner.hidden_size))
        runner._begin(runner.kv_cache, shape(ids), shape([1] * batch))
        decode(embeds, runner.kv_cache, runner.params)
        runner._end(runner.kv_cache)
    for s in ids:
        runner.remove_sequence(s)
    rows = [(n, us, calls[n] // rounds) for n, us in totals.items()]
    return sorted(rows, key=lambda r: -r[1])


def throughput(runners: list, prompt: int, steps: int, rounds: int) -> list[tuple[float, float]]:
    """Per runner, median decode tok/s (one sequence) and prefill tok/s (`prompt` tokens);
    the runners take turns, round by round, and every round has a new prompt."""
    rng = np.random.default_rng(1)
    decode: list[list[float]] = [[] for _ in runners]
    prefill: list[list[float]] = [[] for _ in runners]
    for r in range(rounds):
        toks = [int(t) for t in rng.integers(3, 290, size=prompt)]
        for i, runner in enumerate(runners):
            runner.add_sequence(r)
            t = clock()
            for start in range(0, prompt, runner.prefill_chunk_size):
                runner.forward([(r, toks[start : start + runner.prefill_chunk_size])])
            prefill[i].append(prompt / (clock() - t))
            t = clock()
            for _ in range(steps):
                runner.forward([(r, [7])])
            decode[i].append(steps / (clock() - t))
            runner.remove_sequence(r)
    median = statistics.median
    return [(median(d), median(p)) for d, p in zip(decode, prefill, strict=True)]


def print_breakdown(label: str, rows: list[tuple[str, float, int]]) -> None:
    total = sum(us for _, us, _ in rows)
    print(f"\n{label}")
    for name, us, n in rows[:14]:
        mark = " (MoE)" if MOE_KERNEL.search(name) else ""
        print(f"  {us:9.1f} µs  {100 * us / total:5.1f}%  x{n:<3d} {name}{mark}")
    moe = sum(us for name, us, _ in rows if MOE_KERNEL.search(name))
    print(f"  {total:9.1f} µs in all; grouped-MoE kernels {moe:.1f} µs ({100 * moe / total:.0f}%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reuse-model", type=Path, help="a folder of an earlier run's model")
    ap.add_argument("--artifact", type=Path, help="measure this artifact, compile nothing")
    ap.add_argument("--baseline", type=Path, help="an artifact measured interleaved with it")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--quant", default=None, help="a --quant of tallow compile (q4_0, q4k ...)")
    ap.add_argument("--batch", type=int, default=4, help="sequences in the profiled step")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-time", action="store_true", help="CPU time (TVM_NUM_THREADS=1)")
    args = ap.parse_args()
    if args.cpu_time:
        global clock
        clock = time.process_time

    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    artifact = args.artifact
    if artifact is None:
        model = (args.reuse_model or args.out) / "model"
        if not (model / "config.json").is_file():
            write_model(model, config(args.hidden, args.layers, args.experts, args.top_k))
        t = time.perf_counter()
        opts = CompileOptions(model=str(model), output=args.out / "artifact", quant=args.quant)
        artifact = compile_model(dataclass_quiet(opts))
        print(f"compiled in {time.perf_counter() - t:.0f} s: {artifact}")
    kv = KVCacheConfig(max_batch_size=8, max_total_tokens=4096, prefill_chunk_size=256)
    named = [("this", artifact)] + ([("baseline", args.baseline)] if args.baseline else [])
    runners = [TVMModelRunner(a, kv=kv) for _, a in named]
    for (label, a), runner in zip(named, runners, strict=True):
        rows = kernel_breakdown(runner, args.batch, args.rounds)
        print_breakdown(f"{label} ({a.name}): batch_decode of {args.batch} sequences", rows)
    print()
    for (label, _), (decode, prefill) in zip(
        named, throughput(runners, args.prompt, args.steps, args.rounds), strict=True
    ):
        print(f"{label}: decode {decode:.1f} tok/s (1 sequence), prefill {prefill:.1f} tok/s")


def dataclass_quiet(opts):
    import dataclasses

    return dataclasses.replace(opts, quiet=True)


if __name__ == "__main__":
    main()
