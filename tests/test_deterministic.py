"""Deterministic (batch-invariant) mode: a request's tokens and logprobs do not depend on what
runs beside it (issue 24).

The scheduler half runs on the fake runner (cheap): prefill chunks on a fixed grid whatever
the budget, and generated tokens recomputed one at a time after a preemption. The real half
runs SmolLM2 (Q4_1, int8-activation decode kernels): 16 concurrent greedy requests, and the
same under a KV cache small enough to force preemptions, must give each request the same
token ids and the same logprob bits as it gets alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tvm.relax.frontend import nn

from tallow.compiler.quant import quantize
from tallow.model_defs.quant_ops import QuantLinear
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.request import Request
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.scheduler import Scheduler, SchedulerConfig

from conftest_gguf import smollm2_gguf  # noqa: F401  (fixture)

# -- the scheduler, on the fake runner ---------------------------------------------------------


def _scheduler(**cfg) -> tuple[Scheduler, FakeModelRunner]:
    runner = FakeModelRunner(page_size=4, num_pages=cfg.pop("num_pages", 64), context_window=256)
    config = SchedulerConfig(deterministic=True, prefix_cache_max_tokens=512, **cfg)
    return Scheduler(runner, config), runner


def _add(sched: Scheduler, prompt: list[int], max_tokens: int, rid: str):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return sched.add_request(Request(rid, prompt, params, sched.next_arrival_index()))


def _step(sched: Scheduler, runner: FakeModelRunner, log: list) -> None:
    batch = sched.schedule()
    for it in batch.items:  # (seq, first position, tokens, sample)
        start = it.seq.num_computed_tokens - len(it.token_ids)
        log.append((it.seq.seq_id, start, len(it.token_ids), it.sample))
    logits = runner.forward(batch.forward_items) if batch.items else None
    for row, it in enumerate(batch.items):
        if it.sample:
            it.seq.token_ids.append(int(np.argmax(logits[row])))
            if it.seq.num_output_tokens >= it.seq.request.params.max_tokens:
                sched.finish(it.seq, "length")


def _oracle(runner: FakeModelRunner, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(np.argmax(runner.reference_logits(toks))))
    return toks[len(prompt) :]


def _prompt(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 100 for i in range(n)]


def test_prefill_chunks_lie_on_a_fixed_grid_whatever_the_budget():
    """Normal mode cuts prompts to the step's budget share (here 24 tokens less 3 decodes,
    halved: chunks of 10); deterministic mode cuts every prompt at multiples of the chunk
    size, a chunk that does not fit waits for the next step, and decodes do not shrink the
    budget (they run as a forward of their own)."""
    sched, runner = _scheduler(prefill_chunk_size=16, max_num_batched_tokens=24, max_num_seqs=8)
    decoders = [_add(sched, _prompt(3, s), 30, f"d{s}") for s in range(3)]
    log: list = []
    _step(sched, runner, log)
    a, b = _add(sched, _prompt(50, 1), 2, "a"), _add(sched, _prompt(37, 3), 2, "b")
    while sched.has_work():
        _step(sched, runner, log)
    for seq, n in ((a, 50), (b, 37)):
        chunks = [(start, size) for sid, start, size, _ in log if sid == seq.seq_id]
        grid = [(s, min(16, n - s)) for s in range(0, n, 16)]
        assert chunks[: len(grid)] == grid
        assert seq.output_token_ids == _oracle(runner, seq.token_ids[:n], 2)
    for d in decoders:
        assert d.output_token_ids == _oracle(runner, d.token_ids[:3], 30)


def test_recompute_after_preemption_feeds_generated_tokens_one_at_a_time():
    """A preempted sequence prefills its prompt again, then its generated tokens one per step
    (single tokens go through the decode kernels, as when they were first computed), never
    sampling until it has caught up; outputs equal the oracle's."""
    sched, runner = _scheduler(num_pages=14, prefill_chunk_size=16, max_num_batched_tokens=64)
    prompts = [_prompt(8, 3 * i) for i in range(3)]
    seqs = [_add(sched, p, 20, f"r{i}") for i, p in enumerate(prompts)]
    log: list = []
    while sched.has_work():
        _step(sched, runner, log)
    assert sched.num_preemptions > 0
    for s, p in zip(seqs, prompts, strict=True):
        assert s.output_token_ids == _oracle(runner, p, 20)
        items = [(start, size, sample) for sid, start, size, sample in log if sid == s.seq_id]
        restarts = [i for i, (start, _, _) in enumerate(items) if start == 0][1:]
        for r in restarts:  # after each preemption: the prompt, then one token per step
            assert items[r] == (0, 8, False)
            replay = items[r + 1 :]
            caught_up = next(i for i, it in enumerate(replay) if it[2])
            assert all(size == 1 and not sample for _, size, sample in replay[:caught_up])
            assert [start for start, _, _ in replay[: caught_up + 1]] == list(
                range(8, 8 + caught_up + 1)
            )


# -- the matmul kernels of every CPU level ----------------------------------------------------

K, N = 512, 64
ROWS = range(1, 18)  # one to three row tiles of every kernel, whole and partial
# Formats for each decode path: q4_1 and q6k the AVX2 column tiles (nibbles; split halves with
# the multiplier in float), q8_0 the row tiles; every one the float schedule without AVX2.
QTYPES = ("q4_1", "q6k", "q8_0")
# The row layouts: batch_decode's sequences, and prefill's tokens (one batch_prefill packs the
# chunks of several sequences, so a token's row must not depend on the others either).
LAYOUTS = {"batch_decode": ["b", 1, K], "prefill": [1, "s", K]}


class _Projections(nn.Module):
    def __init__(self):
        for qtype in QTYPES:
            setattr(self, qtype, QuantLinear(K, N, qtype))
        self.dense = nn.Linear(K, N, bias=False)  # an f32 artifact's weights

    def batch_decode(self, x):
        return (*(getattr(self, q)(x) for q in QTYPES), self.dense(x))

    prefill = batch_decode


def _runs_here(level) -> bool:
    from tallow.compiler.cpu_levels import required_features
    from tallow.runtime.cpu_features import host_features, host_platform

    if level.platform != host_platform():
        return False
    return set(required_features(level.tvm_target, level.platform)) <= host_features()


def _level_kernels(level: str) -> dict:
    """{name: PrimFunc} of `_Projections`' matmuls as the CPU backend builds them for `level`."""
    import tvm

    from tallow.compiler.relax_pipeline import fusion_passes
    from tallow.compiler.target import resolve_target

    spec = resolve_target("cpu", "f32", cpu=level)
    target = spec.tvm()
    specs = {f: {"x": nn.spec.Tensor(shape, "float32")} for f, shape in LAYOUTS.items()}
    mod, _ = _Projections().export_tvm(specs)
    with target, spec.backend.pass_context(spec):
        passes = spec.backend.passes_before_fusion(spec, target) + fusion_passes()
        mod = tvm.transform.Sequential(passes)(mod)
        mod = spec.backend.schedule_pass(spec, target)(mod)
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.mark.parametrize(
    "level",
    [
        "native",
        "x86-64-v2",
        "x86-64-v3",
        "x86-64-v4",
        "x86-64-v4-vnni",
        "x86-64-v4-amx",
        "arm64",
        "apple-m1",
    ],
)
def test_matmul_rows_do_not_depend_on_the_batch_at_every_cpu_level(level):
    """The quantized and float matmuls of `batch_decode` and `prefill` as a library for `level`
    gets them (the CPU backend's passes and schedules: AVX2 int8 row or column tiles, AVX-512
    VNNI tiles, the float schedule of `cpu.quant` without AVX2, `cpu.tiled`): row r of 1 to 17
    rows equals row r alone, bit for bit. A level this CPU cannot run (AVX-512, arm64) is
    scheduled for its level and compiled for this CPU, which checks its TIR (tiles, summation
    order), not that level's code generation; the VNNI tiles' intrinsics only compile for a
    CPU that has them (`native` there, and `tests/test_int8_decode.py`)."""
    import tvm
    from tvm.target import Target

    from tallow.compiler.cpu_levels import resolve_level

    runs_here = _runs_here(resolve_level(level))
    if "+avx512vnni" in resolve_level(level).tvm_target.get("mattr", []) and not runs_here:
        pytest.skip(f"this CPU cannot run {level}'s instructions (AVX-512 VNNI, AMX)")
    kernels = _level_kernels(level)
    assert len(kernels) == 2 * (len(QTYPES) + 1), sorted(kernels)
    run_on = Target(resolve_level(level if runs_here else "native").tvm_target)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((max(ROWS), K)).astype(np.float32)
    differ = []
    for name, func in kernels.items():
        assert "tirx.is_scheduled" in func.attrs, name
        with run_on:
            lib = tvm.compile(
                tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), run_on
            )
        qtype = next((q for q in QTYPES if name.startswith(f"quant_matmul_{q}")), None)
        w = rng.standard_normal((N, K)).astype(np.float32)
        w = quantize(w, qtype) if qtype else w
        tokens = isinstance(func.params[0].shape[0], tvm.tirx.IntImm)  # [1, s, K]: prefill
        alone = np.concatenate([_bits(lib, x[r : r + 1], w, tokens) for r in range(max(ROWS))])
        for m in ROWS:
            if not np.array_equal(_bits(lib, x[:m], w, tokens), alone[:m]):
                differ.append(f"{name} at {m} {'tokens' if tokens else 'sequences'}")
    assert not differ, differ


def _bits(lib, x: np.ndarray, w: np.ndarray, tokens: bool) -> np.ndarray:
    """The kernel's output rows for the rows `x` ([m, K]: sequences, or one prefill's
    tokens), as bits."""
    import tvm

    shape = (1, len(x)) if tokens else (len(x), 1)
    out = tvm.runtime.empty((*shape, N), "float32")
    lib["main"](tvm.runtime.tensor(x.reshape(*shape, K)), tvm.runtime.tensor(w), out)
    return out.numpy().reshape(len(x), N).view(np.uint32)


# -- the start-up warning ----------------------------------------------------------------------


def test_start_up_warning_names_what_is_not_checked():
    """Libraries built now say their CPU decode is batch-invariant; one from before, with the
    AVX2 tiles that switched at 8 sequences, is told to recompile; VNNI tiles and float kernels
    (unchanged) pass; a GPU library gets what is checked and what is not."""
    from tallow.runtime.engine_factory import batch_invariance_gap

    now = {"int8_decode_tiles": "avx2", "batch_invariant_decode": True}
    assert batch_invariance_gap("cpu", now) is None
    assert batch_invariance_gap("cpu", {"int8_decode_tiles": "avx512-vnni"}) is None
    assert batch_invariance_gap("cpu", {"decode_activations": "float32"}) is None
    old = batch_invariance_gap("cpu", {"int8_decode_tiles": "avx2"})
    assert "from 8 sequences" in old and "compile the artifact again" in old
    for kind, shuffles in (("cuda", "warp shuffles"), ("metal", "simdgroup shuffles")):
        gpu = batch_invariance_gap(kind, {})
        checked, not_checked = gpu.split("; not checked")
        assert "LowBatchGEMV" in checked and "RMSNorm" in checked
        assert "attention" in not_checked and shuffles in not_checked


# -- SmolLM2 through the engine -----------------------------------------------------------------

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):  # noqa: F811
    from tallow.compiler.pipeline import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("det")
    return compile_model(CompileOptions(model=str(smollm2_gguf), output=out, quiet=True))


def _prompts(engine) -> list[list[int]]:
    """16 prompts of 4 to about 110 tokens, from the test prose."""
    words = (Path(__file__).parent / "data" / "prose.txt").read_text().split()
    rng = np.random.default_rng(24)
    out = []
    for n in rng.integers(3, 80, size=16):
        start = int(rng.integers(0, len(words) - n))
        out.append(engine.tokenizer.encode(" ".join(words[start : start + n])).ids)
    return out


def _ids_and_logprobs(outputs) -> tuple[list[int], list[float]]:
    ids, lps = [], []
    for out in outputs:
        for d in out.outputs:
            ids += d.token_ids
            lps += [lp.logprob for lp in d.logprobs or []]
    assert len(ids) == len(lps) == MAX_TOKENS
    return ids, lps


@pytest.fixture(scope="module")
def alone(smollm2):
    """Each prompt alone, one after the other on one engine (deterministic mode turns the
    prefix cache off: nothing carries over from one to the next)."""
    from tallow.runtime.engine_factory import EngineOptions, build_engine

    engine = build_engine(smollm2, EngineOptions(prefill_chunk_size=64, deterministic=True))
    assert engine.runner.library.details["batch_invariant_decode"] is True
    prompts = _prompts(engine)
    results = [_ids_and_logprobs(engine.generate([p], GREEDY)[0]) for p in prompts]
    return prompts, results


@pytest.mark.slow
def test_sixteen_concurrent_requests_equal_alone_bitwise(smollm2, alone):
    """A 64-token budget admits the 16 prompts over several steps (the longer ones in two
    chunks), so most steps mix prefill chunks with decodes: the decodes must still take the
    decode kernels, and a batch of 16 must give the bits of a batch of one."""
    from tallow.runtime.engine_factory import EngineOptions, build_engine

    prompts, want = alone
    engine = build_engine(
        smollm2, EngineOptions(max_num_seqs=16, prefill_chunk_size=64, deterministic=True)
    )
    runner, mixed = engine.runner, []
    forward = runner.forward

    def counting(items):
        lengths = {len(toks) == 1 for _, toks in items}
        mixed.append(lengths == {True, False})
        return forward(items)

    runner.forward = counting
    got = [_ids_and_logprobs(outs) for outs in engine.generate(prompts, GREEDY)]
    assert sum(mixed) >= 3, "the test meant steps mixing prefill and decode"
    for (ids, lps), (want_ids, want_lps) in zip(got, want, strict=True):
        assert ids == want_ids
        assert lps == want_lps  # float equality: the same bits


@pytest.mark.slow
def test_outputs_after_preemption_equal_alone_bitwise(smollm2, alone):
    """12 pages of 16 tokens for 16 requests: sequences are preempted (7 times when written)
    and recomputed (the prompt through prefill, their generated tokens through decode), and
    end with the bits they have alone."""
    from tallow.runtime.engine_factory import EngineOptions, build_engine

    prompts, want = alone
    engine = build_engine(
        smollm2,
        EngineOptions(
            max_num_seqs=16, prefill_chunk_size=64, kv_cache_mem_mb=8.0, deterministic=True
        ),
    )
    assert engine.runner.num_pages < 14
    got = [_ids_and_logprobs(outs) for outs in engine.generate(prompts, GREEDY)]
    assert engine.stats().num_preemptions > 0
    assert got == want
