"""`serve run tallow.server.ray_app:app key=value ...`: the string arguments Serve passes, as
the application's config, and the autoscaling bounds mapped to Serve's config. Fast: the
application is built, not run."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="needs tallow[ray]")

from tallow.server.ray_app import RayAppConfig, app  # noqa: E402


def test_string_arguments_become_typed_fields():
    config = RayAppConfig.from_args(
        {"artifact": "/m", "replicas": "3", "prefix_cache": "false", "kv_cache_mem_mb": "512"}
    )
    assert (config.artifact, config.replicas, config.prefix_cache) == ("/m", 3, False)
    assert config.kv_cache_mem_mb == 512.0 and config.autoscaling() is None
    with pytest.raises(ValueError, match="unknown argument 'replica'"):
        RayAppConfig.from_args({"artifact": "/m", "replica": "2"})
    with pytest.raises(ValueError, match="unknown argument 'engine_options'"):
        RayAppConfig.from_args({"artifact": "/m", "engine_options": "{}"})


def test_replica_bounds_map_to_serves_autoscaling():
    scaled = RayAppConfig("/m", replicas=2, min_replicas=1, max_replicas=4)
    auto = scaled.autoscaling()
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas) == (1, 4, 2)
    assert auto.target_ongoing_requests == 8.0
    only_max = RayAppConfig("/m", max_replicas=3, target_ongoing_requests=2).autoscaling()
    assert (only_max.min_replicas, only_max.max_replicas) == (1, 3)
    assert only_max.target_ongoing_requests == 2


def test_the_builder_binds_the_ingress_to_the_engine_deployment():
    built = app({"artifact": "/m", "replicas": "2", "max_num_seqs": "4"})
    (bound, max_body) = built._bound_deployment.init_args
    engine = bound._bound_deployment
    assert engine.name == "TallowEngine" and engine.num_replicas == 2
    assert engine.max_ongoing_requests == 4 + 256  # the batch, then the replica's own queue
    router = engine._deployment_config.request_router_config
    assert router.request_router_class == "tallow.server.ray_routing:PromptPrefixRouter"
    assert max_body == 4 * 2**20
