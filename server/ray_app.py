"""tallow on Ray Serve: N engine replicas behind one port, requests routed by prompt prefix.

Two tiers, because Ray's request routers see a handle call's arguments, never an HTTP body:

- `Ingress` (Serve's HTTP ingress, no engine) reads the request, pulls out its prompt text and
  hands a `Forwarded` request to the engine deployment's handle. It relays the answer as it
  streams, and turns what only it can see into OpenAI-shaped errors: a replica that died
  mid-stream (an SSE error event, then `data: [DONE]`; never a hang), Serve's queue being
  full (429).
- `EngineReplica` holds one engine and tallow's own FastAPI app (`create_app`), unchanged, and
  runs each request through it in-process (`asgi_bridge`), so the API key, body limits,
  validation, SSE, 429 and aborting on a client's disconnect behave exactly as in the single
  server. Every answer carries `x-tallow-replica`, and its metrics a `replica` label; the
  probes alone are the ingress's own (they speak for the application).

The engine deployment routes with Ray's `PrefixCacheAffinityRouter` (`ray_routing.py`):
requests whose prompts share a prefix go to the replica that served it (its prefix cache holds
the pages), unless the queues differ by more than `imbalanced_threshold`, when it falls back to
the power of two choices. Nothing is retried: a request whose replica died is answered with an
error, since its tokens may have been sampled already (a request never runs twice silently).

`serve run tallow.server.ray_app:app artifact=PATH` (or a KubeRay RayService's
`import_path`) builds the application from string arguments (`RayAppConfig.from_args`);
`tallow serve --replicas N` builds it from its flags. Only `tallow.runtime` and this package
are imported, never the compiler.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.schema import DeploymentStatus
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from . import paths
from .asgi_bridge import Forwarded, Lifespan, ResponseStart, call
from .errors import APIError
from .protocol import HealthResponse

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-tallow-replica"
# Ray's prefix-cache-affinity router, made safe for requests without a prompt (ray_routing.py).
PREFIX_ROUTER = "tallow.server.ray_routing:PromptPrefixRouter"
_SSE = b"text/event-stream"
ENGINE_DEPLOYMENT = "TallowEngine"
# Engine deployment states in which every replica it wants is running (autoscaling or not).
_CAPACITY = {DeploymentStatus.HEALTHY, DeploymentStatus.UPSCALING, DeploymentStatus.DOWNSCALING}


@dataclass
class RayAppConfig:
    """What the application is built from; every field has a string form for `serve run`."""

    artifact: str  # a folder every node can read, or hf://owner/repo
    model_name: str | None = None
    replicas: int = 1
    min_replicas: int | None = None  # either bound set: Serve autoscales between them
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    threads: int | None = None  # per replica
    device: str | None = None
    max_num_seqs: int = 16
    kv_cache_mem_mb: float | None = None  # per replica
    prefix_cache: bool = True
    max_queued_requests: int = 256  # per replica
    max_body_bytes: int = 4 * 2**20
    shutdown_timeout: float = 30.0
    api_key: str | None = None
    ui: bool = True
    # The Host check and CORS of `server/gate.py`, as on one server: the address the proxy
    # binds, and comma-separated names and origins allowed besides the defaults.
    host: str = "127.0.0.1"
    allowed_hosts: str = ""
    allowed_origins: str = ""
    # False: Serve's default router (power of two choices, load only), for comparison.
    prefix_routing: bool = True
    engine_options: dict[str, Any] = field(default_factory=dict)  # any other EngineOptions
    # Sampling defaults: "model" (the artifact's) or "openai" (neutral), with overrides put
    # over them (`tallow serve --temperature ...`).
    sampling_defaults: str = "model"
    sampling_overrides: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: dict[str, str]) -> RayAppConfig:
        """`serve run ... key=value` arguments (all strings) as a config."""
        out: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for key, value in args.items():
            if key not in types or "dict" in str(types[key]):
                raise ValueError(f"unknown argument {key!r}; known: {sorted(types)}")
            kind = str(types[key])
            if "bool" in kind:
                out[key] = value.lower() in ("1", "true", "yes", "on")
            elif "int" in kind:
                out[key] = int(value)
            elif "float" in kind:
                out[key] = float(value)
            else:
                out[key] = value
        return cls(**out)

    def autoscaling(self) -> AutoscalingConfig | None:
        if self.min_replicas is None and self.max_replicas is None:
            return None
        low = self.min_replicas if self.min_replicas is not None else 1
        high = self.max_replicas if self.max_replicas is not None else max(low, self.replicas)
        return AutoscalingConfig(
            min_replicas=low,
            max_replicas=high,
            initial_replicas=min(max(self.replicas, low), high),
            target_ongoing_requests=self.target_ongoing_requests,
        )


class EngineReplica:
    """One engine and tallow's app; Serve calls `forward` through the ingress's handle."""

    async def __init__(self, config: RayAppConfig) -> None:
        # Serve's replicas need TVM's runtime library only (no compiler stack).
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
        from tallow.runtime.engine_factory import EngineOptions, build_engine
        from tallow.runtime.sampling_defaults import NEUTRAL

        from .app import ServerOptions, create_app

        self.replica = serve.get_replica_context().replica_id.unique_id
        folder = await asyncio.to_thread(_artifact_folder, config.artifact, config.device)
        engine_options = EngineOptions(
            device=config.device,
            max_num_seqs=config.max_num_seqs,
            kv_cache_mem_mb=config.kv_cache_mem_mb,
            prefix_cache=config.prefix_cache,
            threads=config.threads,
            **config.engine_options,
        )
        engine = await asyncio.to_thread(build_engine, folder, engine_options)
        base = engine.model.sampling_defaults if config.sampling_defaults == "model" else NEUTRAL
        options = ServerOptions(
            api_key=config.api_key,
            max_queued_requests=config.max_queued_requests,
            max_body_bytes=config.max_body_bytes,
            shutdown_timeout=config.shutdown_timeout,
            ui=config.ui,
            host=config.host,
            allowed_hosts=_comma_list(config.allowed_hosts),
            allowed_origins=_comma_list(config.allowed_origins),
            replica=self.replica,
            sampling_defaults=base.overridden("command line", **config.sampling_overrides),
        )
        self.app = create_app(engine, config.model_name or folder.resolve().name, options)
        self.lifespan = Lifespan(self.app)
        await self.lifespan.startup()
        self._tag = [(REPLICA_HEADER.encode(), self.replica.encode())]
        # To stderr (Ray keeps it in the worker's log): which process a replica is, for an
        # operator (and tests/test_ray_serve.py) to find it.
        print(
            f"tallow replica {self.replica} (pid {os.getpid()}) serves {folder}",
            file=sys.stderr,
            flush=True,
        )

    async def forward(self, request: Forwarded) -> AsyncIterator[ResponseStart | bytes]:
        async with contextlib.aclosing(call(self.app, request, self._tag)) as parts:
            async for part in parts:
                yield part

    def check_health(self) -> None:
        """Serve's health check: a replica whose app has stopped (its lifespan ended, so the
        engine is shut down) is replaced."""
        if not self.lifespan.running:
            raise RuntimeError("the replica's app is not running")

    async def __del__(self) -> None:
        # Serve has let in-flight requests finish (graceful_shutdown_timeout_s) by now.
        await self.lifespan.shutdown()


class Ingress:
    """Serve's HTTP entry: reads a request, relays it to an engine replica."""

    def __init__(self, engine: Any, max_body_bytes: int) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.draining = False
        self.in_flight = 0  # requests accepted and not yet answered in full

    async def __call__(self, request: Request) -> Response:
        if request.url.path in paths.PROBES:
            return await self._probe(request.url.path)
        if self.draining:
            return APIError(
                503, "the server is shutting down", type="server_error", code="shutting_down"
            ).response()
        self.in_flight += 1
        relayed = False
        try:
            response = await self._forward(request)
            relayed = isinstance(response, StreamingResponse)
            return response
        finally:
            if not relayed:
                self._finished()

    def _finished(self) -> None:
        self.in_flight -= 1

    async def drain(self, timeout: float) -> int:
        """What `tallow serve --replicas` calls on SIGTERM, as the single server drains: new
        requests get 503 (`shutting_down`) and /health/ready 503 while the requests in flight
        get up to `timeout` seconds. Returns how many were still running then."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight

    async def _forward(self, request: Request) -> Response:
        try:
            body = await _read_body(request, self.max_body_bytes)
        except APIError as e:
            return e.response()
        forwarded = Forwarded(
            method=request.method,
            path=request.url.path,
            query_string=request.scope.get("query_string", b""),
            headers=list(request.scope["headers"]),
            body=body,
            prompt=await asyncio.to_thread(routing_text, body) if body else "",
            client=tuple(request.client) if request.client else None,
        )
        parts = self.engine.options(stream=True).forward.remote(forwarded)
        try:
            start = await parts.__anext__()
        except BackPressureError:
            return APIError(
                429,
                "every replica's queue is full; retry later",
                type="server_error",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            ).response()
        except Exception as e:  # the replica died, or none is running
            log.warning("a replica failed before answering: %s", type(e).__name__)
            return _unavailable(type(e).__name__).response()
        assert isinstance(start, ResponseStart), start
        response = StreamingResponse(_relay(parts, start, self._finished), status_code=start.status)
        response.raw_headers = list(start.headers)
        return response

    async def _probe(self, path: str) -> Response:
        """The probes speak for the application, not for one replica: live while the ingress
        answers; ready (and /health) while Serve has the engine deployment at its target, so
        a replica lost and being replaced shows as not ready until capacity is back."""
        if path == paths.HEALTH_LIVE:
            return JSONResponse(HealthResponse(status="ok").model_dump())
        if self.draining:
            return JSONResponse(HealthResponse(status="unavailable").model_dump(), 503)
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(serve.get_replica_context().app_name)
        engine = app.deployments.get(ENGINE_DEPLOYMENT) if app else None
        if engine is None or engine.status not in _CAPACITY:
            return JSONResponse(HealthResponse(status="unavailable").model_dump(), 503)
        return JSONResponse(HealthResponse(status="ok").model_dump())


async def _relay(parts: Any, start: ResponseStart, on_end: Any) -> AsyncIterator[bytes]:
    """The body's chunks; a replica lost mid-stream ends an event stream with an error event
    and `[DONE]` (the status line has gone out already)."""
    sse = any(k.lower() == b"content-type" and v.startswith(_SSE) for k, v in start.headers)
    finished = False
    try:
        async for chunk in parts:
            yield chunk
        finished = True
    except Exception as e:
        log.warning("a replica failed mid-response: %s", type(e).__name__)
        if not sse:
            raise  # a half-sent JSON body: the connection is cut, which clients notice
        error = json.loads(_unavailable(type(e).__name__).response().body)
        yield b"data: " + json.dumps(error).encode() + b"\n\n" + b"data: [DONE]\n\n"
        finished = True
    finally:
        on_end()
        if not finished:  # the client left: stop the sequence on its replica
            parts.cancel()


def _unavailable(what: str) -> APIError:
    return APIError(
        503,
        f"the replica serving this request failed ({what}); it was not retried",
        type="server_error",
        code="replica_unavailable",
    )


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused past `limit` bytes as the replica would (it checks again)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def routing_text(body: bytes) -> str:
    """The text the prefix router matches: chat messages' contents, a completion's prompt, a
    response's input, in order; "" for anything else (the replica validates the body)."""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    for key in ("messages", "prompt", "input"):
        if key in data:
            return _text(data[key])
    return ""


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value)
    if isinstance(value, dict):
        return _text(value.get("content", value.get("text", "")))
    return ""


def _comma_list(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _artifact_folder(spec: str, device: str | None) -> Any:
    from pathlib import Path

    from tallow.runtime import hub_pull

    if hub_pull.is_hub_ref(spec):
        return hub_pull.pull(hub_pull.parse_hub_ref(spec), hub_pull.files_for_device(device))
    return Path(spec)


def build(config: RayAppConfig) -> Any:
    """The Serve application: the ingress bound to the engine deployment."""
    autoscaling = config.autoscaling()
    router = RequestRouterConfig()  # Serve's default
    if config.prefix_routing:
        router = RequestRouterConfig(
            request_router_class=PREFIX_ROUTER,
            # Prefix affinity while queues differ by less than a batch; past that, load wins.
            request_router_kwargs={"imbalanced_threshold": config.max_num_seqs},
        )
    engine = serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        # At least the engine's batch, or Serve caps its batching; the queue beyond it is the
        # replica's own (429 from tallow's app, as on one server).
        max_ongoing_requests=config.max_num_seqs + config.max_queued_requests,
        # Past that in every replica, Serve's own queue; past that, 429 (`BackPressureError`).
        max_queued_requests=config.max_queued_requests,
        num_replicas=None if autoscaling else config.replicas,
        autoscaling_config=autoscaling,
        graceful_shutdown_timeout_s=config.shutdown_timeout,
        health_check_period_s=2,
        ray_actor_options={"num_cpus": config.threads or 1},
        request_router_config=router,
    )
    ingress = serve.deployment(
        Ingress,
        name="TallowIngress",
        max_ongoing_requests=10_000,  # it only relays; the engine replicas bound the work
        graceful_shutdown_timeout_s=config.shutdown_timeout,  # its relays end with the engine's
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engine.bind(config), config.max_body_bytes)


def app(args: dict[str, str]) -> Any:
    """The application builder `serve run tallow.server.ray_app:app artifact=...` calls."""
    return build(RayAppConfig.from_args(args))
