"""Runs on the GPU machine with the runtime-only TVM bundle (no tallow, no tvm.relax).

    python gpu_check_run.py parity  SMALL_CUDA_DIR SMALL_CPU_DIR
    python gpu_check_run.py speed   BIG_CUDA_DIR

Each DIR holds a library and shape.json from `compile_shape.py`. Weights are random
(seeded), made here in the shapes shape.json lists, so nothing large is carried over.
`parity` prefills a prompt and decodes a few steps with the CUDA and the CPU library on the
same weights and compares the logits; `speed` times batched decode at batch 1 and 16.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
import tvm  # noqa: E402  (runtime-only)
from tvm.runtime import vm as tvm_vm  # noqa: E402

PAGE = 16


def _load_cuda_runtime() -> None:
    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


class Model:
    def __init__(self, folder: Path, dev, seed: int = 0, max_batch: int = 16, cheap=False):
        self.info = json.loads((folder / "shape.json").read_text())
        self.dev = dev
        lib = tvm.runtime.load_module(str(folder / self.info["library"]))
        self.vm = tvm_vm.VirtualMachine(lib, dev)
        rng = np.random.default_rng(seed)
        self.params = []
        block = rng.standard_normal(1 << 20, dtype=np.float32)
        for name, shape, dtype in self.info["params"]:
            scale = 1.0 if "norm" in name else 0.02
            base = 1.0 if "norm" in name else 0.0
            if cheap:  # 8B parameters: tile one random block (values do not matter for speed)
                noise = np.resize(block, shape)
            else:
                noise = rng.standard_normal(shape, dtype=np.float32)
            arr = (base + scale * noise).astype(dtype)
            self.params.append(tvm.runtime.tensor(arr, dev))
        cfg = self.info["config"]
        self.hidden = cfg["hidden_size"]
        S = tvm.runtime.ShapeTuple
        self.kv = self.vm["create_paged_kv_cache"](
            S([max_batch]), S([max_batch * 1024]), S([512]), S([PAGE]), S([0])
        )
        get = tvm.get_global_func
        self.add = get("vm.builtin.kv_state_add_sequence")
        self.begin = get("vm.builtin.kv_state_begin_forward")
        self.end = get("vm.builtin.kv_state_end_forward")

    def forward(self, items):
        """items: [(seq_id, tokens)]; returns float32 logits of each item's last token."""
        lengths = [len(t) for _, t in items]
        ids = np.array([x for _, t in items for x in t], dtype=np.int32)
        emb = self.vm["embed"](tvm.runtime.tensor(ids, self.dev), self.params)
        S = tvm.runtime.ShapeTuple
        self.begin(self.kv, S([s for s, _ in items]), S(lengths))
        if max(lengths) == 1:
            emb = emb._create_view((len(items), 1, self.hidden))
            logits, _ = self.vm["batch_decode"](emb, self.kv, self.params)
        else:
            pos = np.cumsum(lengths, dtype=np.int32) - 1
            emb = emb._create_view((1, int(ids.size), self.hidden))
            logits, _ = self.vm["batch_prefill"](
                emb, tvm.runtime.tensor(pos, self.dev), self.kv, self.params
            )
        self.end(self.kv)
        return logits


def parity(cuda_dir: Path, cpu_dir: Path) -> int:
    _load_cuda_runtime()
    gpu, cpu = Model(cuda_dir, tvm.cuda(0)), Model(cpu_dir, tvm.cpu(0))
    vocab = gpu.info["config"]["vocab_size"]
    rng = np.random.default_rng(1)
    prompts = {0: rng.integers(0, vocab, 37).tolist(), 1: rng.integers(0, vocab, 5).tolist()}
    worst = 0.0
    for m in (gpu, cpu):
        for s in prompts:
            m.add(m.kv, s)
    for step in range(6):
        items = list(prompts.items()) if step == 0 else [(s, [t[-1]]) for s, t in prompts.items()]
        a = gpu.forward(items).numpy().astype(np.float32).reshape(len(items), -1)
        b = cpu.forward(items).numpy().astype(np.float32).reshape(len(items), -1)
        err = float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6))
        worst = max(worst, err)
        same = bool((a.argmax(-1) == b.argmax(-1)).all())
        print(f"step {step}: max rel err {err:.2e}, argmax equal {same}")
        for s in prompts:  # feed the CPU's greedy token to both
            prompts[s] = prompts[s] + [int(b[list(prompts).index(s)].argmax())]
    ok = worst < 2e-2
    print(f"PARITY {'OK' if ok else 'FAIL'}: worst relative error {worst:.2e} (f16 vs f32)")
    return 0 if ok and sampler_parity(gpu, cpu) else 1


def sampler_parity(gpu: Model, cpu: Model, rows: int = 64) -> bool:
    """The compiled sampler on the GPU against the CPU build's, on the same logits."""
    vocab = gpu.info["config"]["vocab_size"]
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    controls = np.stack(
        [
            rng.choice([0.0, 0.7, 1.0], rows),  # temperature
            rng.choice([0, 5, 50], rows),  # top_k
            rng.choice([1.0, 0.9, 0.5], rows),  # top_p
            rng.choice([0.0, 0.05], rows),  # min_p
            rng.random(rows),  # uniform draw
        ],
        axis=1,
    ).astype(np.float32)
    out = []
    for m in (gpu, cpu):
        args = [tvm.runtime.tensor(a, m.dev) for a in (logits, controls)]
        out.append(m.vm["sample_tokens"](*args).numpy())
    same = int((out[0] == out[1]).sum())
    greedy = controls[:, 0] == 0
    ok = bool((out[0][greedy] == out[1][greedy]).all()) and same >= rows - 2
    # Sampled rows may differ where float rounding moves u * total across a token boundary.
    print(f"SAMPLER {'OK' if ok else 'FAIL'}: {same}/{rows} rows pick the same token")
    if ok:  # time the kernel alone: 16 rows, inputs already on the device
        args = [tvm.runtime.tensor(a[:16], gpu.dev) for a in (logits, controls)]
        gpu.vm["sample_tokens"](*args)
        gpu.dev.sync()
        t = time.perf_counter()
        for _ in range(20):
            gpu.vm["sample_tokens"](*args)
        gpu.dev.sync()
        print(f"sample_tokens, 16 rows: {(time.perf_counter() - t) / 20 * 1e3:.3f} ms")
    return ok


def speed(cuda_dir: Path, steps: int = 64) -> int:
    _load_cuda_runtime()
    dev = tvm.cuda(0)
    m = Model(cuda_dir, dev, max_batch=16, cheap=True)
    vocab = m.info["config"]["vocab_size"]
    for batch in (1, 16):
        seqs = list(range(100 * batch, 100 * batch + batch))
        for s in seqs:
            m.add(m.kv, s)
        m.forward([(s, list(range(1, 33))) for s in seqs])  # a 32-token prompt each
        tokens = [(s, [7]) for s in seqs]
        for _ in range(4):  # warm up
            m.forward(tokens)
        dev.sync()
        t = time.perf_counter()
        for i in range(steps):
            m.forward([(s, [(i * 31 + s) % vocab]) for s in seqs])
        dev.sync()
        dt = time.perf_counter() - t
        print(
            f"decode batch {batch}: {steps * batch / dt:.1f} tok/s "
            f"({1000 * dt / steps:.2f} ms/step)"
        )
    return 0


if __name__ == "__main__":
    cmd, *dirs = sys.argv[1:]
    fn = {"parity": parity, "speed": speed}[cmd]
    sys.exit(fn(*map(Path, dirs)))
