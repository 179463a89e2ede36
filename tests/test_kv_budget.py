"""The KV budget planner (`engine_factory.plan_kv_cache`) and what `build_engine` hands the
runner, with every expected number computed here from the manifest's KV fields."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from tallow.runtime import engine_factory
from tallow.runtime.engine_factory import EngineOptions, build_engine, plan_kv_cache
from tallow.runtime.errors import TallowError
from tallow.runtime.manifest import Manifest

pytestmark = pytest.mark.slow  # compiles the tiny model (once per session)

MB = 2**20
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@pytest.fixture(scope="module")
def art(tiny_artifact):
    return tiny_artifact("qwen3", "f32")


@pytest.fixture(scope="module")
def manifest(art):
    return Manifest.read(art)


@pytest.fixture(scope="module")
def kv(art):
    """The manifest's KV fields, read as plain YAML (not through `Manifest`)."""
    return yaml.safe_load((art / "manifest.yaml").read_text())["kv_cache"]


def per_token(kv) -> int:
    return 2 * kv["num_layers"] * kv["num_kv_heads"] * kv["head_dim"] * DTYPE_BYTES[kv["dtype"]]


def whole_pages(tokens: int, page: int) -> int:
    return tokens // page * page


def test_bytes_per_token_from_the_kv_fields(manifest, kv):
    assert kv["num_layers"] > 0 and kv["num_kv_heads"] > 0 and kv["head_dim"] > 0
    assert engine_factory.kv_bytes_per_token(manifest) == per_token(kv)
    # A float16 cache holds half as many bytes per token.
    half = dataclasses.replace(manifest.kv_cache, dtype="float16")
    m16 = dataclasses.replace(manifest, kv_cache=half)
    assert engine_factory.kv_bytes_per_token(m16) == per_token(kv) // 2


@pytest.mark.parametrize("mb", [0.05, 0.3, 1.0])
def test_explicit_budget_is_whole_pages(manifest, kv, mb):
    plan = plan_kv_cache(manifest, EngineOptions(max_num_seqs=64, kv_cache_mem_mb=mb), 0)
    budget = int(mb * MB)
    assert plan.budget_bytes == budget and plan.bytes_per_token == per_token(kv)
    assert plan.total_tokens == whole_pages(budget // per_token(kv), kv["page_size"])
    assert plan.total_tokens % kv["page_size"] == 0
    assert plan.total_tokens * per_token(kv) <= budget


def test_budget_capped_at_max_num_seqs_full_windows(manifest, kv):
    for seqs in (1, 3):
        plan = plan_kv_cache(manifest, EngineOptions(max_num_seqs=seqs, kv_cache_mem_mb=1e5), 0)
        assert plan.total_tokens == whole_pages(seqs * kv["context_window"], kv["page_size"])


def test_budget_from_free_memory_and_fraction(manifest, kv, monkeypatch):
    free, weights = 64 * MB, 10 * MB
    monkeypatch.setattr(engine_factory, "_free_memory", lambda choice: free)
    plan = plan_kv_cache(manifest, EngineOptions(max_num_seqs=512, memory_fraction=0.01), weights)
    budget = int(0.01 * (free - weights))
    assert plan.budget_bytes == budget
    assert plan.total_tokens == whole_pages(budget // per_token(kv), kv["page_size"])
    # Weights bigger than the memory leave nothing: a clear error, not a negative cache.
    with pytest.raises(TallowError, match="less than one page"):
        plan_kv_cache(manifest, EngineOptions(memory_fraction=0.5), free + 1)


@pytest.mark.parametrize("mb", [0, -1, -0.5])
def test_non_positive_budget_is_a_clear_error(manifest, mb):
    with pytest.raises(TallowError, match="--kv-cache-mem must be positive"):
        plan_kv_cache(manifest, EngineOptions(kv_cache_mem_mb=mb), 0)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_bad_memory_fraction_is_a_clear_error(manifest, fraction):
    with pytest.raises(TallowError, match="--gpu-memory-fraction must be in"):
        plan_kv_cache(manifest, EngineOptions(memory_fraction=fraction), 0)


def test_budget_under_one_page_is_a_clear_error(manifest, kv):
    one_page_mb = per_token(kv) * kv["page_size"] / MB
    with pytest.raises(TallowError, match="less than one page"):
        plan_kv_cache(manifest, EngineOptions(kv_cache_mem_mb=one_page_mb * 0.9), 0)
    plan = plan_kv_cache(manifest, EngineOptions(kv_cache_mem_mb=one_page_mb), 0)
    assert plan.total_tokens == kv["page_size"]


def test_build_engine_gives_the_runner_the_planned_pages(art, kv):
    mb = 0.2
    engine = build_engine(art, EngineOptions(max_num_seqs=4, kv_cache_mem_mb=mb))
    runner = engine.runner
    tokens = whole_pages(int(mb * MB) // per_token(kv), kv["page_size"])
    assert runner.page_size == kv["page_size"]
    # TVM's paged cache keeps one page beyond max_total_tokens // page_size.
    assert runner.num_pages in (tokens // kv["page_size"], tokens // kv["page_size"] + 1)
    assert runner.num_free_pages() == runner.num_pages
    assert runner.max_batch_size == 4 and engine.scheduler.config.max_num_seqs == 4
