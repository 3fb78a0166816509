"""`skillpool serve`: its flags and its run (the console script, skillpool.cli.main, dispatches here)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from skillpool.runtime.threads import add_threads_argument, set_threads

from .config import ServerConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    ServerConfig.add_cli_args(p)
    add_threads_argument(p)
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")


def run(args: argparse.Namespace) -> int:
    import signal

    import uvicorn

    from skillpool.adapters_store.objects import StoreUnavailable
    from skillpool.runtime.openmp import in_own_thread

    from .app import create_app
    from .auth import KeyFileError, KeyRing
    from .bootstrap import build_components

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    set_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = ServerConfig.from_cli_args(args)
    try:
        keys = KeyRing.from_config(cfg)  # before the model loads: a bad keys file stops the start at once
    except KeyFileError as e:
        raise SystemExit(f"skillpool serve: {e}") from None
    cluster_flags = (cfg.ingress_replicas != 1, cfg.ray_address, cfg.replica_gpus, cfg.affinity_group_size != 1)
    if cfg.replicas is not None or any(cluster_flags):
        from .cluster.launch import serve_cluster  # imports Ray only after checking that it is installed

        return serve_cluster(cfg, args.threads, args.log_level)
    signal.signal(signal.SIGHUP, lambda *_: keys.reload())  # uvicorn handles SIGINT and SIGTERM, not this one
    try:
        # loading runs torch on every core: in a thread of its own, whose OpenMP pool ends with it (openmp.py)
        components = in_own_thread(lambda: build_components(cfg), "skillpool-start")
    except StoreUnavailable as e:  # says which store and why: unreachable, credentials refused, no such bucket
        raise SystemExit(f"skillpool serve: cannot start: {e}") from None
    app = create_app(components, keys)
    print(
        f"skillpool: serving {components.base.model_id} with {len(components.pool.records())} skill(s) on http://{cfg.host}:{cfg.port}",
        file=sys.stderr,
        flush=True,
    )
    try:
        # the access log is ours (request_ids.py): each line ends with the request's x-request-id
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=args.log_level.lower(), access_log=False)
    finally:
        components.close()
    return 0
