"""`skillpool serve`: its flags and its run (the console script, skillpool.cli.main, dispatches here)."""

from __future__ import annotations

import argparse
import sys

from skillpool.runtime.process import setup_process

from .config import ServerConfig, add_serve_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_serve_arguments(p)


def run(args: argparse.Namespace) -> int:
    import signal

    from skillpool.adapters_store.objects import StoreUnavailable
    from skillpool.runtime.openmp import in_own_thread
    from skillpool.runtime.processes import exit_now, on_stop_signals

    from .app import create_app
    from .auth import KeyFileError, KeyRing
    from .bootstrap import build_components
    from .stopping import serve

    cfg = ServerConfig.from_cli_args(args)
    setup_process(args.threads, cfg.observability.log_level)
    try:
        keys = KeyRing.from_config(cfg)  # before the model loads: a bad keys file stops the start at once
    except KeyFileError as e:
        raise SystemExit(f"skillpool serve: {e}") from None
    cluster_flags = (
        cfg.cluster.ingress_replicas != 1,
        cfg.cluster.ray_address,
        cfg.cluster.replica_gpus,
        cfg.cluster.affinity_group_size != 1,
    )
    if cfg.cluster.replicas is not None or any(cluster_flags):
        from .cluster.launch import serve_cluster  # imports Ray only after checking that it is installed

        return serve_cluster(cfg, args.threads, cfg.observability.log_level)
    signal.signal(signal.SIGHUP, lambda *_: keys.reload())
    on_stop_signals(exit_now)  # while it starts there is nothing to drain: stop at once, with what it started
    try:
        # loading runs torch on every core: in a thread of its own, whose OpenMP pool ends with it (openmp.py)
        components = in_own_thread(lambda: build_components(cfg), "skillpool-start")
    except StoreUnavailable as e:  # says which store and why: unreachable, credentials refused, no such bucket
        raise SystemExit(f"skillpool serve: cannot start: {e}") from None
    app = create_app(components, keys)
    print(
        f"skillpool: serving {components.base.model_id} with {len(components.pool.records())} skill(s) on http://{cfg.http.host}:{cfg.http.port}",
        file=sys.stderr,
        flush=True,
    )
    return serve(
        app, components, cfg.http.host, cfg.http.port, cfg.observability.log_level.lower(), cfg.http.shutdown_timeout_s
    )
