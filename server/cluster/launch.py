"""`skillpool serve --replicas N [--ingress-replicas M] [--ray-address ADDR]`: check, connect, deploy, wait.

Everything that can be wrong is found before anything starts: flags that need --replicas or --redis-url, Ray
missing (the error names the install command), a --ray-address nothing answers at (within CONNECT_S). Then a
local Ray (no address) or the cluster's, Ray Serve's HTTP proxy on --host/--port, the application (deployments.py)
and the hub (hub.py); SIGINT or SIGTERM deletes the application, and a local Ray stops with the process.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from ..config import ServerConfig

log = logging.getLogger(__name__)

INSTALL = "pip install -e .[cluster] (or bash setup.sh --cluster)"
CONNECT_S = 5.0  # a --ray-address that does not accept a connection this fast is reported unreachable
KEYS_NOTE = "skillpool: the ingress replicas re-read the keys file {} within 2 s of a change"


def check_flags(cfg: ServerConfig) -> None:
    """The cluster flags' combinations; SystemExit naming the flag."""
    if cfg.cluster.replicas is None:
        given = [f for f, on in (("--ingress-replicas", cfg.cluster.ingress_replicas != 1), ("--ray-address", cfg.cluster.ray_address),
                                 ("--replica-gpus", cfg.cluster.replica_gpus),
                                 ("--affinity-group-size", cfg.cluster.affinity_group_size != 1)) if on]  # fmt: skip
        raise SystemExit(f"skillpool serve: {', '.join(given)} only apply with --replicas N")
    if cfg.cluster.ingress_replicas > 1 and not cfg.training.redis_url:
        raise SystemExit(
            "skillpool serve: --ingress-replicas above 1 needs --redis-url: training jobs and their records must be "
            "shared by every ingress replica (Redis), not kept in one process"
        )


def require_ray() -> ModuleType:
    """Ray Serve, or SystemExit naming the install command (before anything starts)."""
    try:
        import ray
        import ray.serve  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"skillpool serve: --replicas needs Ray Serve, which is not installed: {INSTALL} ({e})"
        ) from None
    return ray


def gcs_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) to probe for a --ray-address, None for Ray's own words (auto, local) that name no endpoint."""
    if address in ("auto", "local"):
        return None
    parts = urlsplit(address if "://" in address else f"ray-gcs://{address}")
    if not parts.hostname:
        raise SystemExit(f"skillpool serve: --ray-address {address!r}: expected HOST:PORT or ray://HOST:PORT")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        raise SystemExit(f"skillpool serve: --ray-address {address!r} has no valid port (HOST:PORT)")
    return parts.hostname, port


def probe(address: str, timeout: float = CONNECT_S) -> None:
    """SystemExit within `timeout` when nothing accepts connections at `address`."""
    endpoint = gcs_endpoint(address)
    if endpoint is None:
        return
    try:
        with socket.create_connection(endpoint, timeout=timeout):
            pass
    except OSError as e:
        raise SystemExit(f"skillpool serve: cannot reach the Ray cluster at --ray-address {address}: {e}") from None


def connect(ray: Any, address: str | None, need_cpus: int) -> bool:
    """Join the cluster at `address` or start a local one; True when this process started it (it stops it too)."""
    if address:
        probe(address)
        ray.init(address=address, namespace="skillpool", log_to_driver=True)
        return False
    cpus = max(os.cpu_count() or 1, need_cpus)  # the replicas' CPU requests are bookkeeping: let them all start
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, namespace="skillpool")
    return True


def serve_cluster(cfg: ServerConfig, threads: int | None, log_level: str = "info") -> int:
    check_flags(cfg)
    ray = require_ray()
    assert cfg.cluster.replicas is not None
    from .deployments import REPLICA_ENV, ClusterSpec

    for k, v in REPLICA_ENV.items():  # this process routes nothing, but a handle made here reads them too
        os.environ.setdefault(k, v)
    spec = ClusterSpec(cfg, cfg.cluster.replicas, cfg.cluster.ingress_replicas, threads)
    local = connect(ray, cfg.cluster.ray_address, cfg.cluster.replicas * (threads or 1))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # the ingress replicas re-read the keys file when it changes; SIGHUP (which would end this process) says so
    signal.signal(
        signal.SIGHUP, lambda *_: print(KEYS_NOTE.format(cfg.http.api_keys_file), file=sys.stderr, flush=True)
    )
    try:
        deploy(spec, cfg.http.host, cfg.http.port)
        print(
            f"skillpool: serving on Ray Serve, {spec.replicas} engine replica(s) ({cfg.serving.engine}) and "
            f"{spec.ingress_replicas} ingress replica(s), on http://{cfg.http.host}:{cfg.http.port}",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(1.0):
            pass
    finally:
        undeploy(spec, local)
    return 0


def deploy(spec: Any, host: str = "127.0.0.1", port: int = 8000, ingress: bool = True) -> Any:
    """The application on Ray Serve (the ingress and the engines, or the engines alone); its handle once every
    replica is up."""
    from ray import serve

    from .deployments import build_app, engine_app
    from .hub import hub_handle

    hub_handle(spec.hub_name)  # before any replica: they all find it by name
    if ingress:
        serve.start(http_options={"host": host, "port": port})
        return serve.run(build_app(spec), name=spec.app_name, route_prefix="/")
    return serve.run(engine_app(spec), name=spec.app_name, route_prefix=None)


def undeploy(spec: Any, local: bool) -> None:
    """Delete the application and its hub; stop Ray if this process started it."""
    import ray
    from ray import serve

    from .hub import NAMESPACE

    try:
        serve.delete(spec.app_name)
        ray.kill(ray.get_actor(spec.hub_name, namespace=NAMESPACE))
    except Exception as e:  # Ray is going away already
        log.warning("cleanup: %s", e)
    if local:
        serve.shutdown()
        ray.shutdown()
