"""`skillpool worker`: a trainer process that pulls jobs from Redis and writes skills to the shared store.

Each skill it stores is announced on the skill-event bus (the Redis stream every server reads). With
`--metrics-port` it serves the training metrics (trainer.jobs.metrics) for Prometheus. It imports nothing of the
server: the job runner is trainer.jobs.runner, the router is built by router.build.

SIGTERM or SIGINT stops it cleanly: the job it trains stops at its next check and goes back to the front of the
queue (redis_queue.py) within `--shutdown-timeout`, then it exits 0; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from skillpool.adapters_store.disk_cache import DEFAULT_CACHE_BYTES
from skillpool.router.flags import add_router_flags, router_settings
from skillpool.runtime.dtype import DTYPE_SETTING, DTYPES
from skillpool.runtime.flags import byte_size
from skillpool.runtime.process import setup_process
from skillpool.runtime.processes import (
    SHUTDOWN_TIMEOUT_S,
    exit_now,
    on_stop_signals,
    shutdown_timeout,
    stop_descendants,
)
from skillpool.runtime.threads import add_threads_argument

from ..keys import DEFAULT_PREFIX


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url", default=os.environ.get("SKILLPOOL_REDIS_URL"), required=not os.environ.get("SKILLPOOL_REDIS_URL")
    )
    p.add_argument("--redis-prefix", default=DEFAULT_PREFIX)
    p.add_argument(
        "--data-dir", type=Path, default=Path("./data"), help="the skill store shared with the servers"
    )  # serve's default too (ServerConfig.data_dir)
    p.add_argument(
        "--adapter-store",
        default=os.environ.get("SKILLPOOL_ADAPTER_STORE") or None,
        help="where skills are stored, as for serve: a folder (default: the data dir) or s3://BUCKET/PREFIX with the "
        "standard AWS settings (env SKILLPOOL_ADAPTER_STORE)",
    )
    p.add_argument(
        "--adapter-cache-bytes",
        type=byte_size,
        default=DEFAULT_CACHE_BYTES,
        help="with an s3:// store: the disk cache of downloaded skill files under the data dir (2GiB, 512MiB; 0: none)",
    )
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--device", default=None)
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=os.environ.get(DTYPE_SETTING) or None,
        help="what training computes in, as for serve: auto (bfloat16 on a CPU with AVX-512 BF16 or AMX, float32 "
        "elsewhere), float32 or bfloat16 (env SKILLPOOL_DTYPE)",
    )
    p.add_argument(
        "--lease-s",
        type=float,
        default=30.0,
        help="a job whose worker is silent this long goes back to the queue (renewed every third of it)",
    )
    p.add_argument("--max-tries", type=int, default=3, help="starts of one job before it fails as lost")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve the training metrics for Prometheus at http://HOST:PORT/metrics (0: off)",
    )
    p.add_argument("--metrics-host", default="0.0.0.0", help="the address --metrics-port binds")
    p.add_argument(
        "--shutdown-timeout",
        type=shutdown_timeout,
        default=SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM or SIGINT: how long (seconds) the running job gets to stop and go back to the queue",
    )
    add_threads_argument(p)
    add_router_flags(p)
    p.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    import threading

    from prometheus_client import CollectorRegistry, start_http_server

    from skillpool.adapters_store.store import StoreUnavailable, open_store
    from skillpool.router.build import make_router
    from skillpool.runtime.base_model import resolve_base_model

    from ..bus import RedisEventBus, announcer
    from ..skill_trainer import SkillTrainer
    from .metrics import TrainingMetrics
    from .redis_queue import RedisJobQueue
    from .runner import make_runner

    setup_process(args.threads, args.log_level)
    on_stop_signals(exit_now)  # while it starts there is no job to give back: stop at once
    try:
        store = open_store(args.data_dir, args.adapter_store, args.adapter_cache_bytes)
    except StoreUnavailable as e:
        raise SystemExit(f"skillpool worker: cannot start: {e}") from None
    base = resolve_base_model(args.model)
    # the worker's router only prepares keys; it re-reads the shared store before each sapt job
    trainer = SkillTrainer(
        store,
        make_router(router_settings(args), base, device=args.device),
        base,
        device=args.device,
        sync_router=True,
        dtype=args.dtype,
    )
    bus = RedisEventBus(args.redis_url, args.redis_prefix)  # every server serves a stored skill once it reads it
    metrics = TrainingMetrics(CollectorRegistry())  # its own registry: only the training series, as documented
    queue = RedisJobQueue(
        args.redis_url,
        make_runner(trainer, metrics),
        announcer(bus),
        metrics.job_ended,
        prefix=args.redis_prefix,
        lease_s=args.lease_s,
        max_tries=args.max_tries,
    )
    metrics.watch(queue, "redis")
    http = None
    if args.metrics_port:
        http, _ = start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
    served = f", metrics on {args.metrics_host}:{args.metrics_port}" if http is not None else ""
    print(
        f"skillpool worker: training for {base.model_id}, store {store.location}, queue {args.redis_url}{served}",
        file=sys.stderr,
        flush=True,
    )
    done = threading.Event()
    on_stop_signals(lambda _: done.set())
    while not done.wait(1.0):  # a timed wait: the signal handler runs between two
        pass
    print("skillpool worker: stopping; a running job goes back to the queue", file=sys.stderr, flush=True)
    queue.close(args.shutdown_timeout)
    bus.close()
    if http is not None:
        http.shutdown()
    stop_descendants(grace_s=3.0)
    return 0
