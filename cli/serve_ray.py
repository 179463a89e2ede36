"""`tallow serve --replicas N`: the same OpenAI API on one port through N engine replicas on
Ray Serve (`tallow.server.ray_app`), on a local Ray or one joined with `--ray-address`.

Ray is an optional extra (`pip install 'tallow[ray]'`): nothing here imports it until a
replica flag is given, so `tallow serve --help` and the single server never need it.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from tallow.cli.arg_types import positive_int
from tallow.cli.sampling_flags import FLAGS
from tallow.cli.speculative_flags import speculative_config
from tallow.runtime.errors import TallowError


def add_replica_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on Ray Serve (pip install 'tallow[ray]'; docs/scale-out.md)")
    g.add_argument(
        "--replicas",
        type=positive_int,
        help="engine replicas behind one port, routed by prompt prefix (default: one process, "
        "no Ray); --threads and --kv-cache-mem are per replica",
    )
    g.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    g.add_argument("--min-replicas", type=int, help="autoscale from this many replicas")
    g.add_argument("--max-replicas", type=positive_int, help="autoscale up to this many replicas")
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=8.0,
        help="requests per replica the autoscaler aims for (default 8)",
    )


def wants_ray(args: argparse.Namespace) -> bool:
    return any(
        getattr(args, name, None) is not None
        for name in ("replicas", "ray_address", "min_replicas", "max_replicas")
    )


def run_ray_serve(args: argparse.Namespace, folder: Path, name: str) -> int:
    """Serve on Ray until SIGINT/SIGTERM, then let Serve drain and stop."""
    try:
        import ray
        from ray import serve

        from tallow.server.ray_app import RayAppConfig, build
    except ImportError as e:
        raise TallowError(f"--replicas needs Ray Serve: pip install 'tallow[ray]' ({e})") from e
    replicas = args.replicas or 1
    config = RayAppConfig(
        artifact=str(Path(folder).resolve()),
        model_name=name,
        replicas=replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        threads=args.threads or _threads_per_replica(args.max_replicas or replicas),
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        kv_cache_mem_mb=args.kv_cache_mem,
        prefix_cache=not args.no_prefix_cache,
        max_queued_requests=args.max_queued_requests,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        api_key=args.api_key or None,
        ui=not args.no_ui,
        host=args.host,
        allowed_hosts=args.allowed_hosts,
        allowed_origins=args.allowed_origins,
        engine_options={
            "prefill_chunk_size": args.prefill_chunk_size,
            "memory_fraction": args.gpu_memory_fraction,
            "prefix_cache_max_tokens": args.prefix_cache_max_tokens,
            "deterministic": args.deterministic,
            "speculative": speculative_config(args),  # checked before Ray starts
        },
        sampling_defaults=args.sampling_defaults,
        sampling_overrides={
            n: getattr(args, n) for n in FLAGS.values() if getattr(args, n) is not None
        },
    )
    port = args.port or _free_port(args.host)
    started = time.monotonic()
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False)
    left = 0
    try:
        serve.start(http_options={"host": args.host, "port": port})
        serve.run(build(config), name="tallow", route_prefix="/", blocking=False)
        took = time.monotonic() - started
        print(f"{replicas} replica(s) up in {took:.0f} s", file=sys.stderr)
        print(f"serving {name} on http://{args.host}:{port}", file=sys.stderr, flush=True)
        _wait_for_signal()
        # As the single server drains: new requests get 503 while those in flight finish,
        # up to --shutdown-timeout. Then the application is deleted (its replicas stop their
        # engines) before Serve itself: serve.shutdown() alone stopped the proxy at once,
        # cutting in-flight streams.
        print("draining", file=sys.stderr, flush=True)
        ingress = serve.get_app_handle("tallow")
        left = ingress.drain.remote(config.shutdown_timeout).result(
            timeout_s=config.shutdown_timeout + 30
        )
        if left:
            print(f"shutdown timeout passed with {left} request(s) running", file=sys.stderr)
        serve.delete("tallow")
        if not args.ray_address:  # a cluster of our own; a joined one keeps Serve running
            serve.shutdown()
    finally:
        ray.shutdown()
    return 1 if left else 0


def _threads_per_replica(replicas: int) -> int:
    """Kernel threads per replica when --threads is not given: the cores shared out, so that N
    replicas do not each spin a pool over every core."""
    import os

    return max(1, (os.cpu_count() or 1) // replicas)


def _free_port(host: str) -> int:
    """A port for --port 0. Serve's proxy binds it itself and reports no port back, so one is
    picked here and released (something else could take it in between; an explicit --port
    avoids that)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
