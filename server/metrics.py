"""Prometheus metrics, one registry per app (several apps in one process must not collide).

Engine counters are read from `engine.stats()` at scrape time by a custom collector, so
nothing has to be pushed from the step thread; per-request histograms are observed by the
request handlers.

Two gauges are there for the Kubernetes Gateway API Inference Extension, whose endpoint picker
scrapes each model server for the queue length and the KV cache's fill (a fraction, 0 to 1):
`tallow_num_requests_waiting` and `tallow_kv_cache_usage_perc` (vLLM's names, prefixed as ours
are; the picker takes the names as flags).

Under Ray Serve several replicas answer /metrics behind one port: each replica's samples then
carry a `replica` label (`ServerMetrics(replica=...)`), so a scrape says which one it reached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tallow.runtime.request import EngineStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = {
            "num_requests_waiting": ("sequences waiting for admission", s.num_waiting),
            "num_requests_running": ("sequences holding KV cache", s.num_running),
            "kv_cache_pages_used": ("KV cache pages in use", s.kv_pages_used),
            "kv_cache_pages_total": ("KV cache pages in all", s.kv_pages_total),
            "kv_cache_usage_perc": (
                "KV cache pages in use, as a fraction (1: full)",
                s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0,
            ),
            "step_latency_last_seconds": ("latency of the last engine step", s.last_step_latency_s),
            "step_latency_avg_seconds": ("mean engine step latency", s.avg_step_latency_s),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"tallow_{name}", doc, value=value)
        counters = {
            "preemptions": ("sequences preempted", s.num_preemptions),
            "prefix_cache_hit_tokens": (
                "prompt tokens from the prefix cache",
                s.prefix_cache_hit_tokens,
            ),
            "prompt_tokens": ("prompt tokens admitted", s.prompt_tokens),
            "generation_tokens": ("tokens generated", s.generated_tokens),
            "engine_steps": ("engine steps run", s.num_steps),
            # speculative decoding; the acceptance rate is accepted / proposed
            "spec_proposed_tokens": ("tokens proposed for verification", s.spec_proposed_tokens),
            "spec_accepted_tokens": (
                "proposed tokens the model agreed with",
                s.spec_accepted_tokens,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"tallow_{name}", doc, value=value)


class _Labelled(Collector):
    """Every sample of `registry`, with `labels` added (the replica that answers)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._registry, self._labels = registry, labels

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, **self._labels}) for s in family.samples]
            yield out


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], replica: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self._exposed: CollectorRegistry = self.registry
        if replica is not None:
            self._exposed = CollectorRegistry(auto_describe=False)
            self._exposed.register(_Labelled(self.registry, {"replica": replica}))
        self.registry.register(_EngineCollector(stats))
        r = self.registry
        self.requests = Counter(
            "tallow_requests", "finished requests", ["endpoint", "finish_reason"], registry=r
        )
        self.rejected = Counter(
            "tallow_requests_rejected", "requests answered with an error", ["status"], registry=r
        )
        self.latency = Histogram(
            "tallow_request_latency_seconds",
            "end-to-end request latency",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "tallow_time_to_first_token_seconds",
            "time to the first generated token",
            ["endpoint"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "tallow_request_prompt_tokens",
            "prompt tokens per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "tallow_request_generation_tokens",
            "generated tokens per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.queued = Gauge(
            "tallow_server_queued_requests",
            "accepted requests without a first output yet",
            registry=r,
        )
        self.in_flight = Gauge("tallow_server_requests_in_flight", "requests in flight", registry=r)

    def render(self) -> bytes:
        return generate_latest(self._exposed)
