"""The GPU check's device half: runs tallow's own runtime (`TVMModelRunner`, the engine) on
artifacts `gpu_check.sh prepare` built, with the runtime-only TVM bundle (no compiler).

    python gpu_check_run.py fill    ARTIFACT            # random weights for a skeleton
    python gpu_check_run.py parity  SMALL_CUDA SMALL_CPU
    python gpu_check_run.py speed   ARTIFACT [--gpu H200]
    python gpu_check_run.py engine  ARTIFACT
    python gpu_check_run.py nccl    LIBTALLOW_DISCO_NCCL.so
    python gpu_check_run.py profile ARTIFACT [--out DIR]   # needs PyTorch (the GPU image's)

`fill` writes the weight shards a skeleton's manifest names (compile_shape.py --artifact):
norms 1, float weights N(0, 0.02), GGUF q4k blocks random bytes with their two f16 scales
(d, dmin) set to 2^-10 so no block decodes to inf or NaN. `parity` loads the same compiled
small model (real weights) on the GPU and on the CPU and compares the logits of a prefill and
a few greedy decode steps; `speed` times decode at batch 1, 12 (run as 16), 16 and 64 and a
512-token prefill through `TVMModelRunner.forward`, next to the roofline bound
(`runtime/roofline.py`); `engine` runs 64 requests through the engine's step loop.
Runs on this machine too (CPU artifacts), which is how the script itself is tested.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

Q4K_BLOCK, Q4K_SCALE = 144, np.float16(2**-10)


def _runner(folder: Path, device: str, batch: int = 64, chunk: int = 512):
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    kv = KVCacheConfig(
        max_batch_size=batch, max_total_tokens=batch * 1024, prefill_chunk_size=chunk
    )
    return TVMModelRunner(folder, device=device, kv=kv)


def fill(folder: Path, seed: int = 0) -> int:
    from safetensors.numpy import save_file

    from tallow.runtime.manifest import Manifest

    manifest = Manifest.read(folder)
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(1 << 22, dtype=np.float32) * 0.02
    raw = rng.integers(0, 256, 1 << 24, dtype=np.uint8)
    shards: dict[str, dict[str, np.ndarray]] = {}
    t = time.perf_counter()
    for p in manifest.params:
        if p.dtype == "uint8":
            if p.quant != "q4k":
                raise SystemExit(f"fill: {p.name} is {p.quant}; only q4k blocks are filled")
            arr = np.resize(raw, p.shape).reshape(-1, Q4K_BLOCK)
            arr[:, 0:4] = np.frombuffer(np.array([Q4K_SCALE] * 2).tobytes(), np.uint8)
            arr = arr.reshape(p.shape)
        elif "norm" in p.name:
            arr = np.ones(p.shape, dtype=p.dtype)
        else:
            arr = np.resize(noise, p.shape).astype(p.dtype)
        shards.setdefault(p.shard, {})[p.name] = arr
    for shard, tensors in shards.items():
        save_file(tensors, str(folder / shard))
    size = sum(a.nbytes for s in shards.values() for a in s.values())
    print(
        f"fill: {size / 2**30:.2f} GiB in {len(shards)} shard(s), {time.perf_counter() - t:.0f} s"
    )
    return 0


def _compare(gpu, cpu, prompts: dict[int, list[int]], label: str, steps: int = 6) -> bool:
    """A prefill and `steps - 1` greedy decode steps on both runners; True when the logits
    agree within f16's reach (both continue with the CPU's token, so one near-tie that flips
    an argmax does not derail the rest)."""
    for r in (gpu, cpu):
        for s in prompts:
            r.add_sequence(s)
    worst, same_all = 0.0, True
    for step in range(steps):
        items = list(prompts.items()) if step == 0 else [(s, [t[-1]]) for s, t in prompts.items()]
        a = np.asarray(gpu.forward(items), dtype=np.float32)
        b = np.asarray(cpu.forward(items), dtype=np.float32)
        err = float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6))
        same = bool((a.argmax(-1) == b.argmax(-1)).all())
        worst, same_all = max(worst, err), same_all and same
        print(f"{label} step {step}: max |gpu - cpu| / max |cpu| = {err:.2e}, argmax equal {same}")
        for i, s in enumerate(prompts):
            prompts[s] = prompts[s] + [int(b[i].argmax())]
    for r in (gpu, cpu):
        for s in prompts:
            r.remove_sequence(s)
    # f16 activations against f32: judged on the logits; an argmax may flip on a near-tie.
    ok = worst < 3e-2
    print(
        f"PARITY {label} {'OK' if ok else 'FAIL'}: worst {worst:.2e} ({gpu.manifest.dtype} vs "
        f"CPU {cpu.manifest.dtype}); argmax equal at every step: {same_all}"
    )
    return ok


def _single_sequence_decode(runner, on: bool) -> None:
    """Route one running sequence through `decode` (the CUDA-graph-captured function) instead
    of `batch_decode`: GPU device kinds do not yet (runtime/devices.py)."""
    runner.device_kind = dataclasses.replace(runner.device_kind, single_sequence_decode=on)


def parity(cuda_dir: Path, cpu_dir: Path, device: str = "cuda") -> int:
    gpu, cpu = _runner(cuda_dir, device, 4), _runner(cpu_dir, "cpu", 4)
    rng = np.random.default_rng(1)
    vocab = gpu.vocab_size
    prompts = {0: rng.integers(0, vocab, 37).tolist(), 1: rng.integers(0, vocab, 5).tolist()}
    ok = _compare(gpu, cpu, prompts, "batch_decode")
    _single_sequence_decode(gpu, True)
    ok = _compare(gpu, cpu, {2: rng.integers(0, vocab, 21).tolist()}, "decode") and ok
    return 0 if ok else 1


def _sync(runner) -> None:
    runner.device.sync()


def _print_decode(label: str, measured: float, dt: float, bound, gpu_name: str) -> None:
    print(
        f"{label}: {measured:9,.1f} tok/s ({dt * 1e3:.2f} ms/step); "
        f"roofline {bound.tokens_per_second:9,.1f} tok/s on {gpu_name}: "
        f"{measured / bound.tokens_per_second:.0%} of the bound"
    )


def speed(folder: Path, gpu_name: str = "H200", device: str = "cuda", steps: int = 32) -> int:
    from tallow.runtime.roofline import decode_roofline

    runner = _runner(folder, device, 64)
    vocab, context = runner.vocab_size, 512
    print(f"{folder.name}: {runner.manifest.quantization}, {runner.manifest.dtype}")
    seq = 0
    # 12 runs as 16 (batch buckets, runtime/decode_padding.py): its step time shows what the
    # padding rows cost next to batch 16's.
    for batch in (1, 12, 16, 64):
        seqs = list(range(seq, seq + batch))
        seq += batch
        t = time.perf_counter()
        for s in seqs:  # a 512-token context each, prefilled one sequence at a time
            runner.add_sequence(s)
            runner.forward([(s, [(7 * i + s) % vocab for i in range(context)])])
        _sync(runner)
        if batch == 1:
            dt = time.perf_counter() - t
            print(f"prefill 512 tokens: {context / dt:,.0f} tok/s ({dt * 1e3:.1f} ms, first call)")
            t = time.perf_counter()
            runner.add_sequence(10_000)
            runner.forward([(10_000, [(5 * i) % vocab for i in range(context)])])
            _sync(runner)
            dt = time.perf_counter() - t
            print(f"prefill 512 tokens: {context / dt:,.0f} tok/s ({dt * 1e3:.1f} ms, warm)")
            runner.remove_sequence(10_000)
        for i in range(3):  # warm-up (and CUDA-graph capture of this batch size)
            runner.forward([(s, [(i + s) % vocab]) for s in seqs])
        _sync(runner)
        t = time.perf_counter()
        for i in range(steps):
            runner.forward([(s, [(i * 31 + s) % vocab]) for s in seqs])
        _sync(runner)
        dt = (time.perf_counter() - t) / steps
        bound = decode_roofline(runner.manifest, gpu_name, batch, context + 3 + steps // 2)
        _print_decode(f"decode batch {batch:2d}", batch / dt, dt, bound, gpu_name)
        if batch == 1:  # the same sequence through `decode`, the CUDA-graph-captured function
            _single_sequence_decode(runner, True)
            for i in range(3):
                runner.forward([(s, [(i + s) % vocab]) for s in seqs])
            _sync(runner)
            t = time.perf_counter()
            for i in range(steps):
                runner.forward([(s, [(i * 31 + s) % vocab]) for s in seqs])
            _sync(runner)
            dt = (time.perf_counter() - t) / steps
            _print_decode("decode (one-sequence fn)", 1 / dt, dt, bound, gpu_name)
            _single_sequence_decode(runner, False)
        for s in seqs:
            runner.remove_sequence(s)
    return 0


def profile(folder: Path, out: Path | None, device: str = "cuda", steps: int = 8) -> int:
    """Where a step's GPU time goes, kernel by kernel: PyTorch's profiler (CUPTI records every
    kernel of the process, TVM's too) around `steps` decode steps at batch 1 and 16 and one
    512-token prefill, next to the wall time (the gap is host time between kernels)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if device == "cuda":
        torch.cuda.init()
    runner = _runner(folder, device, 64)
    vocab, context, seq = runner.vocab_size, 512, 0
    for batch in (1, 16, 0):
        seqs = list(range(seq, seq + max(batch, 1)))
        seq += len(seqs)
        for s in seqs:
            runner.add_sequence(s)
            if batch:
                runner.forward([(s, [(7 * i + s) % vocab for i in range(context)])])
        for i in range(3):
            runner.forward([(s, [(i + s) % vocab]) for s in seqs])
        _sync(runner)
        kind = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
        with torch_profile(activities=[kind]) as prof:
            t = time.perf_counter()
            if batch:
                for i in range(steps):
                    runner.forward([(s, [(i * 31 + s) % vocab]) for s in seqs])
            else:  # one prefill of 512 tokens on a fresh sequence
                runner.forward([(seqs[0], [(5 * i) % vocab for i in range(context)])])
            _sync(runner)
            wall = time.perf_counter() - t
        per = steps if batch else 1
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        gpu = sum(e.self_device_time_total for e in events) / 1e3 / per
        label = f"decode batch {batch}" if batch else "prefill 512"
        print(f"{label}: wall {wall * 1e3 / per:.2f} ms, kernels {gpu:.2f} ms per step")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
            print(
                f"  {e.self_device_time_total / 1e3 / per:8.3f} ms {e.count / per:6.1f}x  "
                f"{e.key[:90]}"
            )
        if out is not None:
            prof.export_chrome_trace(str(out / f"trace_{label.replace(' ', '_')}.json"))
        for s in seqs:
            runner.remove_sequence(s)
    return 0


def engine(folder: Path, device: str = "cuda", requests: int = 64, tokens: int = 64) -> int:
    from tallow.runtime.engine_factory import EngineOptions, build_engine
    from tallow.runtime.sampling_params import SamplingParams

    eng = build_engine(folder, EngineOptions(device=device, max_num_seqs=requests))
    vocab = eng.runner.vocab_size
    prompts = [[(13 * i + j) % vocab for j in range(32)] for i in range(requests)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    eng.generate(prompts[:1], params)  # warm-up
    t = time.perf_counter()
    out = eng.generate(prompts, params)
    dt = time.perf_counter() - t
    made = sum(o[-1].usage.completion_tokens for o in out)
    print(f"engine: {requests} requests x {tokens} tokens: {made / dt:,.0f} tok/s ({dt:.1f} s)")
    return 0


def nccl(library: Path) -> int:
    """tallow's NCCL module (runtime/native/disco_nccl.cc) on one GPU: Disco's ProcessSession
    with one worker (a thread of this process), `init_ccl("nccl", 0)`, then an all-reduce, an
    all-gather and a broadcast of known data, read back. One rank moves no bytes between GPUs:
    this checks the module against a real driver and NCCL, not the links."""
    from tallow.runtime import disco_runtime, nccl_module

    disco = disco_runtime.disco()
    import tvm

    nccl_module.load(library)
    missing = [
        f
        for f in nccl_module.FUNCTIONS
        if tvm.get_global_func(nccl_module.PREFIX + f, allow_missing=True) is None
    ]
    print(
        f"nccl: {len(nccl_module.FUNCTIONS) - len(missing)} functions registered; missing {missing}"
    )
    sess = disco.ProcessSession(1, entrypoint="tallow.runtime.tp_worker")
    sess.init_ccl("nccl", 0)
    x = np.random.default_rng(3).standard_normal(2048).astype(np.float16)
    src, dst = sess.empty(x.shape, "float16"), sess.empty(x.shape, "float16")
    src.debug_copy_from(0, tvm.runtime.tensor(x))
    sess.allreduce(src, dst, "sum")
    got = dst.debug_get_from_remote(0).numpy()
    gathered = sess.empty(x.shape, "float16")
    sess.allgather(src, gathered)
    bcast = sess.broadcast(tvm.runtime.tensor(x))
    back = bcast.debug_get_from_remote(0).numpy()
    dev = str(dst.debug_get_from_remote(0).device)
    ok = (
        np.array_equal(got, x)
        and np.array_equal(gathered.debug_get_from_remote(0).numpy(), x)
        and np.array_equal(back, x)
    )
    print(
        f"NCCL {'OK' if ok and not missing else 'FAIL'}: one rank on {dev}: all-reduce, "
        f"all-gather and broadcast return their input"
    )
    sess.shutdown()
    return 0 if ok and not missing else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["fill", "parity", "speed", "engine", "nccl", "profile"])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--gpu", default="H200")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="profile: where its traces go")
    args = ap.parse_args()
    if args.command == "fill":
        return fill(args.folders[0])
    if args.command == "parity":
        return parity(*args.folders, device=args.device)
    if args.command == "speed":
        return speed(args.folders[0], args.gpu, args.device)
    if args.command == "profile":
        return profile(args.folders[0], args.out, args.device)
    if args.command == "nccl":
        return nccl(args.folders[0])
    return engine(args.folders[0], args.device)


if __name__ == "__main__":
    sys.exit(main())
