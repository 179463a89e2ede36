"""The cluster conventions of the single-process server (issue 34): Kubernetes' liveness and
readiness probes, and the gauges the Gateway API Inference Extension scrapes. Fast: the fake
runner, no TVM."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hygiene_server import make_server
from prometheus_client.parser import text_string_to_metric_families

from tallow.runtime.request import EngineStats
from tallow.server import paths
from tallow.server.metrics import ServerMetrics

KEY = {"Authorization": "Bearer secret"}


@pytest.fixture
def server(hygiene_bundle):
    s = make_server(hygiene_bundle, api_key="secret")
    yield s
    s.stop()


def status(base: str, path: str, headers: dict[str, str] | None = None) -> int:
    return httpx.get(base + path, headers=headers or {}, timeout=30).status_code


def test_probes_need_no_key_and_ready_says_ready(server):
    base = server.base_url
    assert status(base, paths.HEALTH_LIVE) == 200
    assert status(base, paths.HEALTH_READY) == 200
    assert httpx.get(base + paths.HEALTH_READY).json() == {"status": "ok"}
    assert status(base, paths.HEALTH) == 200
    assert status(base, paths.MODELS) == 401  # the key still guards the API


def test_draining_is_live_but_not_ready(server):
    base = server.base_url
    server.app.state.tallow.draining = True
    assert status(base, paths.HEALTH_LIVE) == 200
    assert status(base, paths.HEALTH_READY) == 503
    assert httpx.get(base + paths.HEALTH_READY).json() == {"status": "unavailable"}
    assert status(base, paths.HEALTH) == 503
    assert status(base, paths.MODELS, KEY) == 503


def test_loading_is_live_but_not_ready(server):
    # The app before its lifespan ran (the engine not started): what a pod answers while the
    # model loads. httpx's ASGI transport runs no lifespan.
    from tallow.server.app import create_app

    app = create_app(server.engine, "tiny")

    async def probe() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return [(await c.get(p)).status_code for p in paths_in_order]

    paths_in_order = (paths.HEALTH_LIVE, paths.HEALTH_READY, paths.HEALTH)
    assert asyncio.run(probe()) == [200, 503, 503]


def stats(used: int, total: int, waiting: int) -> EngineStats:
    return EngineStats(
        num_waiting=waiting,
        num_running=2,
        num_preemptions=0,
        kv_pages_used=used,
        kv_pages_total=total,
        prefix_cache_hit_tokens=0,
        prompt_tokens=0,
        generated_tokens=0,
        num_steps=0,
        last_step_latency_s=0.0,
        avg_step_latency_s=0.0,
    )


def samples(metrics: ServerMetrics) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


@pytest.mark.parametrize(("used", "total", "fraction"), [(3, 12, 0.25), (0, 0, 0.0), (7, 7, 1.0)])
def test_the_inference_gateway_gauges(used, total, fraction):
    got = samples(ServerMetrics(lambda: stats(used, total, waiting=5)))
    (kv,) = got["tallow_kv_cache_usage_perc"]
    assert kv.value == pytest.approx(fraction)
    (waiting,) = got["tallow_num_requests_waiting"]
    assert waiting.value == 5


def test_a_replica_labels_every_sample():
    metrics = ServerMetrics(lambda: stats(1, 4, waiting=0), replica="r7")
    metrics.requests.labels(endpoint="chat", finish_reason="stop").inc()
    got = samples(metrics)
    assert got["tallow_kv_cache_usage_perc"][0].value == pytest.approx(0.25)
    assert got["tallow_requests_total"][0].labels == {
        "endpoint": "chat",
        "finish_reason": "stop",
        "replica": "r7",
    }
    assert all(s.labels.get("replica") == "r7" for group in got.values() for s in group)
    plain = samples(ServerMetrics(lambda: stats(1, 4, waiting=0)))
    assert all("replica" not in s.labels for group in plain.values() for s in group)
