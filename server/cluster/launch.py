"""`skillpool serve --replicas N [--ingress-replicas M] [--ray-address ADDR]`: check, connect, deploy, wait.

Everything that can be wrong is found before anything starts: flags that need --replicas or --redis-url, Ray
missing (the error names the install command), a --ray-address nothing answers at (within CONNECT_S). Then a
local Ray (no address) or the cluster's, Ray Serve's HTTP proxy on --host/--port, the application (deployments.py)
and the hub (hub.py).

The first SIGINT or SIGTERM drains the ingress replicas as one server drains (through the stop notice, stop.py),
deletes the application, and stops a local Ray with every process it started (a cluster given by --ray-address is
left running); one while it deploys stops the deployment at once. A second signal exits at once, taking a local
Ray's processes with it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from skillpool.runtime.processes import on_stop_signals, stop_descendants
from skillpool.runtime.reaper import start_reaper

from ..config import ServerConfig

log = logging.getLogger(__name__)

INSTALL = "pip install -e .[cluster] (or bash setup.sh --cluster)"
CONNECT_S = 5.0  # a --ray-address that does not accept a connection this fast is reported unreachable
DRAINED_SLACK_S = 10.0  # beyond --shutdown-timeout: the ingress replicas' own ending of what was left
SWEEP_GRACE_S = 3.0  # a process still below this one once Ray stopped: SIGTERM, then SIGKILL after this long
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
    """Join the cluster at `address` or start a local one; True when this process started it (it stops it too,
    and a reaper does if this process is killed: runtime/reaper.py)."""
    if address:
        probe(address)
        ray.init(address=address, namespace="skillpool", log_to_driver=True)
        return False
    start_reaper()
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
    stop, deploying = threading.Event(), [True]

    def first_signal(sig: int) -> None:
        stop.set()
        if deploying[0]:  # nothing serves yet: interrupt the deployment, then undeploy
            raise Interrupted(signal.Signals(sig).name)

    on_stop_signals(first_signal)
    # the ingress replicas re-read the keys file when it changes; SIGHUP (which would end this process) says so
    signal.signal(
        signal.SIGHUP, lambda *_: print(KEYS_NOTE.format(cfg.http.api_keys_file), file=sys.stderr, flush=True)
    )
    local = False
    try:
        local = connect(ray, cfg.cluster.ray_address, cfg.cluster.replicas * (threads or 1))
        on_stop_signals(first_signal)  # again: ray.init put its own SIGTERM handler (sys.exit, no drain) in place
        deploy(spec, cfg.http.host, cfg.http.port)
        deploying[0] = False
        print(
            f"skillpool: serving on Ray Serve, {spec.replicas} engine replica(s) ({cfg.serving.engine}) and "
            f"{spec.ingress_replicas} ingress replica(s), on http://{cfg.http.host}:{cfg.http.port}",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(1.0):
            pass
        drain(spec, cfg.http.shutdown_timeout_s)
    except Interrupted as e:
        print(f"skillpool: {e}: stopping the deployment", file=sys.stderr, flush=True)
    finally:
        deploying[0] = False
        undeploy(spec, local)
        stop_descendants(SWEEP_GRACE_S)  # whatever a local Ray left
    return 0


class Interrupted(Exception):
    """A stop signal while the application deploys."""


def drain(spec: Any, timeout_s: float) -> None:
    """Have every ingress replica drain (stop.py) and wait for them, within the timeout and its slack."""
    import ray

    from .stop import notice_handle

    print(
        f"skillpool: stopping; the requests in flight get up to {timeout_s:g} s (another signal stops at once)",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.monotonic()
    notice = notice_handle(spec.stop_name)
    ray.get(notice.begin.remote(timeout_s))
    drained = ray.get(notice.wait_drained.remote(spec.ingress_replicas, timeout_s + DRAINED_SLACK_S))
    log.info("stopping: %d of %d ingress replica(s) drained in %.1f s", drained, spec.ingress_replicas,
             time.monotonic() - t0)  # fmt: skip


def deploy(spec: Any, host: str = "127.0.0.1", port: int = 8000, ingress: bool = True) -> Any:
    """The application on Ray Serve (the ingress and the engines, or the engines alone); its handle once every
    replica is up."""
    import ray
    from ray import serve

    from .deployments import build_app, engine_app
    from .hub import hub_handle
    from .stop import notice_handle

    hub_handle(spec.hub_name)  # before any replica: they all find it by name
    ray.get(notice_handle(spec.stop_name).reset.remote())
    if ingress:
        serve.start(http_options={"host": host, "port": port})
        return serve.run(build_app(spec), name=spec.app_name, route_prefix="/")
    return serve.run(engine_app(spec), name=spec.app_name, route_prefix=None)


def undeploy(spec: Any, local: bool) -> None:
    """Delete the application and its hub; stop Ray if this process started it."""
    import ray
    from ray import serve

    from .hub import NAMESPACE

    if not ray.is_initialized():  # stopped before it connected: nothing deployed (its processes are swept)
        return
    try:
        serve.delete(spec.app_name)
        for name in (spec.hub_name, spec.stop_name):
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    except Exception as e:  # Ray is going away already
        log.warning("cleanup: %s", e)
    if local:
        serve.shutdown()
        ray.shutdown()
