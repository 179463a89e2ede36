"""The model's end-of-sequence ids reach the engine `build_engine` makes (issue 24: an engine
built with no EOS ids passed every test). The artifact's runner is swapped for a scripted fake
that answers three tokens and then EOS, so only the factory's wiring is under test."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from tallow.runtime import engine_factory
from tallow.runtime.artifact import load_tokenizer
from tallow.runtime.engine_factory import EngineOptions, build_engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.manifest import Manifest
from tallow.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # compiles the tiny model (once per session)

SCRIPT = [40, 41, 42]
PROMPT = [11, 12, 13, 200, 201]


@pytest.fixture(scope="module")
def art(tiny_artifact):
    return tiny_artifact("qwen3", "f32")


def artifact_eos(art) -> int:
    """The tokenizer's EOS, read from the artifact's own tokenizer files (not the manifest)."""
    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    name = json.loads((art / "tokenizer_config.json").read_text())["eos_token"]
    return tok.token_to_id(name if isinstance(name, str) else name["content"])


class ScriptedArtifactRunner(FakeModelRunner):
    """Stands in for `TVMModelRunner(folder, ...)`: the artifact's tokenizer and KV sizes, and
    logits that write SCRIPT after any prompt, then EOS."""

    made: list[ScriptedArtifactRunner] = []

    def __init__(self, folder, device=None, threads=None, kv=None) -> None:
        manifest = Manifest.read(folder)
        self.tokenizer = load_tokenizer(folder, manifest)
        self.eos = artifact_eos(folder)
        page = manifest.kv_cache.page_size
        super().__init__(
            page_size=page,
            num_pages=kv.max_total_tokens // page,
            vocab_size=self.tokenizer.tokenizer.get_vocab_size(with_added_tokens=True),
            context_window=manifest.kv_cache.context_window,
            max_batch_size=kv.max_batch_size,
        )
        self.kv_config = kv
        ScriptedArtifactRunner.made.append(self)

    def _logits(self, history: list[int]) -> np.ndarray:
        k = next(k for k in range(len(SCRIPT), -1, -1) if k == 0 or history[-k:] == SCRIPT[:k])
        out = np.full(self.vocab_size, -30.0, dtype=np.float32)
        out[SCRIPT[k] if k < len(SCRIPT) else self.eos] = 30.0
        return out


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(engine_factory, "TVMModelRunner", ScriptedArtifactRunner)
    monkeypatch.setattr(engine_factory, "runner_class", lambda *a, **kw: ScriptedArtifactRunner)


def test_factory_passes_the_tokenizers_eos_ids(art):
    engine = build_engine(art, EngineOptions(max_num_seqs=2, kv_cache_mem_mb=0.5))
    eos = artifact_eos(art)
    assert engine.eos_token_ids == frozenset([eos])
    assert engine.eos_token_ids == frozenset(engine.runner.tokenizer.eos_token_ids)
    assert engine.model.eos_token_ids == frozenset([eos])  # what the server's routes use


def test_model_eos_ends_generation_with_stop(art, scripted):
    engine = build_engine(art, EngineOptions(max_num_seqs=2, kv_cache_mem_mb=0.5))
    runner = ScriptedArtifactRunner.made[-1]
    assert engine.runner is runner
    params = SamplingParams(max_tokens=20, temperature=0.0)
    outs = engine.generate([PROMPT], params)[0]
    ids = [t for o in outs for d in o.outputs for t in d.token_ids]
    reasons = [d.finish_reason for o in outs for d in o.outputs if d.finish_reason]
    assert reasons == ["stop"]
    assert ids[:3] == SCRIPT and len(ids) <= 4  # SCRIPT, and at most the EOS itself
    # ignore_eos runs past it to the limit: the stop above came from EOS, not the script.
    outs = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    ids = [t for o in outs[0] for d in o.outputs for t in d.token_ids]
    assert len(ids) == 6 and ids[3] == runner.eos
    assert [d.finish_reason for o in outs[0] for d in o.outputs if d.finish_reason] == ["length"]


def test_factory_sizes_the_runner_from_the_plan(art, scripted):
    options = EngineOptions(max_num_seqs=3, kv_cache_mem_mb=0.5, prefix_cache_max_tokens=64)
    build_engine(art, options)
    runner = ScriptedArtifactRunner.made[-1]
    plan = engine_factory.plan_kv_cache(Manifest.read(art), options, 0)
    page = runner.page_size
    assert runner.kv_config.max_total_tokens == plan.total_tokens
    assert runner.kv_config.max_batch_size == 3 + 64 // page  # sequences + prefix entries
    assert runner.kv_config.prefill_chunk_size == options.prefill_chunk_size
    assert runner.max_batch_size == 3
