"""`skillpool` command line: `skillpool serve ...`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

# Before torch loads OpenMP: threads that wait sleep instead of spinning. A server runs the engine, the
# router's MiniLM and a trainer on threads of one process (and a worker may share the cores); with
# spinning waits their pools fight over the cores: on 2 cores beside another busy process a decode step
# of SmolLM2 took 244 ms (3.6 s at 16 rows) instead of 40 ms (140 ms).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from skillpool.router import MODES, RouterSettings  # noqa: E402
from skillpool.router.sapt import REPLAY_SOURCES

from .config import ServerConfig
from .engines import ENGINES


def _threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=int(os.environ["SKILLPOOL_THREADS"]) if os.environ.get("SKILLPOOL_THREADS") else None,
        help="CPU threads for torch (env SKILLPOOL_THREADS; default: every core). When a server and a worker share "
        "a machine, give each its own share (e.g. 1 and 1 on 2 cores): two full thread pools on the same cores "
        "slow serving by more than 10x",
    )


def _set_threads(n: int | None) -> None:
    if n is None:
        return
    if n < 1:
        raise SystemExit("--threads must be at least 1")
    import torch

    torch.set_num_threads(n)
    torch.set_num_interop_threads(max(1, min(n, 2)))


def _router_arguments(p: argparse.ArgumentParser) -> None:
    r = RouterSettings()
    p.add_argument(
        "--router-mode",
        choices=MODES,
        default=r.mode,
        help="dtkr (SLM keys), sapt (query projector) or centroid (baseline)",
    )
    p.add_argument("--router-keys", type=int, default=r.n_keys, help="keys per skill")
    p.add_argument("--router-top-k", type=int, default=r.top_k)
    p.add_argument(
        "--router-mix-keep-ratio",
        type=float,
        default=r.mix_keep_ratio,
        help="a mix keeps only skills with at least this fraction of the top skill's weight (default 0: all above 5%%)",
    )
    p.add_argument("--router-temperature", type=float, default=r.temperature)
    p.add_argument("--router-threshold-percentile", type=float, default=r.threshold_percentile)
    p.add_argument("--router-threshold-margin", type=float, default=r.threshold_margin)
    p.add_argument(
        "--router-white-threshold-percentile",
        type=float,
        default=r.white_threshold_percentile,
        help="dtkr: gate percentile of a skill's own inputs' held-out whitened scores",
    )
    p.add_argument(
        "--router-white-threshold-margin",
        type=float,
        default=r.white_threshold_margin,
        help="dtkr: ... minus this margin (larger: fewer of a skill's own requests fall back, more unseen ones pass)",
    )
    p.add_argument(
        "--router-format-gate",
        choices=("on", "off"),
        default="on" if r.format.enabled else "off",
        help="send a request to the base model when it lacks the fixed prompt text of every skill it resembles",
    )
    p.add_argument(
        "--sapt-replay",
        choices=REPLAY_SOURCES,
        default=r.sapt.replay,
        help="sapt: replay the stored real samples or generated pseudo inputs",
    )
    p.add_argument("--sapt-lambda", type=float, default=r.sapt.arm_lambda, help="sapt: weight of attentive reflection")
    p.add_argument(
        "--sapt-generated",
        type=int,
        default=r.sapt.generated,
        help="sapt: inputs drawn per earlier skill from its stored Gaussian for attentive reflection (0: off)",
    )


def _router_settings(args: argparse.Namespace) -> RouterSettings:
    r = RouterSettings()
    return RouterSettings(
        mode=args.router_mode,
        n_keys=args.router_keys,
        top_k=args.router_top_k,
        mix_keep_ratio=args.router_mix_keep_ratio,
        temperature=args.router_temperature,
        threshold_percentile=args.router_threshold_percentile,
        threshold_margin=args.router_threshold_margin,
        white_threshold_percentile=args.router_white_threshold_percentile,
        white_threshold_margin=args.router_white_threshold_margin,
        sapt=replace(r.sapt, replay=args.sapt_replay, arm_lambda=args.sapt_lambda, generated=args.sapt_generated),
        format=replace(r.format, enabled=args.router_format_gate == "on"),
    )


def _serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    d = ServerConfig()
    p = sub.add_parser("serve", help="run the OpenAI-compatible server with an in-process trainer")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--data-dir", type=Path, default=d.data_dir, help="skill store, jobs (default ./data)")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="local Hugging Face LLaMA-family checkpoint (default: packaged SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("SKILLPOOL_API_KEY"),
        help="a bearer token with role chat, named api-key: chat, models, its own files and jobs read-only "
        "(env SKILLPOOL_API_KEY)",
    )
    p.add_argument(
        "--admin-api-key",
        "--admin-key",
        dest="admin_key",
        default=os.environ.get("SKILLPOOL_ADMIN_KEY"),
        help="a bearer token with role admin, named admin: everything. Alone, it leaves only chat and models open "
        "to callers without a key (env SKILLPOOL_ADMIN_KEY)",
    )
    p.add_argument(
        "--api-keys-file",
        type=Path,
        default=os.environ.get("SKILLPOOL_API_KEYS_FILE") or None,  # an empty variable (compose's default): no file
        help="keys, one 'NAME ROLE KEY' a line (roles chat, train, admin; # comments), re-read on SIGHUP "
        "(env SKILLPOOL_API_KEYS_FILE). With no key at all every endpoint is open",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    _threads_argument(p)
    p.add_argument("--engine", choices=ENGINES, default=d.engine, help="the engine that generates")
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=d.batch_window_s * 1000,
        help="routing: wait this long to batch embeddings",
    )
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="rows decoding at once")
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=d.max_batched_tokens,
        help="tokens per engine step (decode rows + prefill); longer prompts are prefilled in chunks",
    )
    p.add_argument("--max-waiting", type=int, default=d.max_waiting, help="beyond this many waiting requests: 429")
    p.add_argument(
        "--max-upload-mb", type=float, default=d.max_upload_bytes / 2**20, help="dataset uploads beyond this: 413"
    )
    p.add_argument(
        "--max-request-mb", type=float, default=d.max_request_bytes / 2**20, help="other request bodies beyond: 413"
    )
    p.add_argument(
        "--max-loaded-skills",
        type=int,
        default=d.max_loaded_skills,
        help="keep only this many skills' adapters in the engine (least recently used leave; default: all)",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=d.prefix_cache_tokens,
        help="keep the KV of this many prompt tokens for prompts that start alike (blocks of 16; 0: off)",
    )
    p.add_argument("--max-loras", type=int, default=d.max_loras, help="vllm: adapters (mixes) in one batch")
    p.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras, help="vllm: adapters cached in host memory")
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=d.max_lora_rank,
        help="vllm: largest mix rank (sum of its skills' ranks); larger mixes drop their smallest weights",
    )
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="vllm: context length")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    _router_arguments(p)
    p.add_argument(
        "--redis-url",
        default=os.environ.get("SKILLPOOL_REDIS_URL"),
        help="job queue and skill events in Redis (env SKILLPOOL_REDIS_URL)",
    )
    p.add_argument("--redis-prefix", default=d.redis_prefix)
    p.add_argument(
        "--no-trainer", action="store_true", help="with --redis-url: only enqueue; `skillpool worker` trains"
    )
    p.add_argument("--log-level", default="info")


def _worker_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("worker", help="run a trainer worker that pulls jobs from Redis and writes to a shared store")
    p.add_argument(
        "--redis-url", default=os.environ.get("SKILLPOOL_REDIS_URL"), required=not os.environ.get("SKILLPOOL_REDIS_URL")
    )
    p.add_argument("--redis-prefix", default=ServerConfig().redis_prefix)
    p.add_argument(
        "--data-dir", type=Path, default=ServerConfig().data_dir, help="the skill store shared with the servers"
    )
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--device", default=None)
    p.add_argument(
        "--lease-s",
        type=float,
        default=30.0,
        help="a job whose worker is silent this long goes back to the queue (renewed every third of it)",
    )
    p.add_argument("--max-tries", type=int, default=3, help="starts of one job before it fails as lost")
    _threads_argument(p)
    _router_arguments(p)
    p.add_argument("--log-level", default="info")


def _worker(args: argparse.Namespace) -> int:
    import signal
    import threading

    from skillpool.adapters_store.base_model import resolve_base_model
    from skillpool.adapters_store.store import SkillStore
    from skillpool.trainer.redis_jobs import RedisJobQueue
    from skillpool.trainer.skill_trainer import SkillTrainer

    from .bootstrap import make_router, make_runner
    from .metrics import Metrics

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _set_threads(args.threads)
    base = resolve_base_model(args.model)
    store = SkillStore(args.data_dir)
    # the worker's router only prepares keys; it re-reads the shared store before each sapt job
    trainer = SkillTrainer(
        store, make_router(_router_settings(args), base, device=args.device), base, device=args.device, sync_router=True
    )
    queue = RedisJobQueue(
        args.redis_url,
        make_runner(trainer, Metrics()),
        prefix=args.redis_prefix,
        lease_s=args.lease_s,
        max_tries=args.max_tries,
    )
    print(
        f"skillpool worker: training for {base.model_id}, store {args.data_dir}, queue {args.redis_url}",
        file=sys.stderr,
        flush=True,
    )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    queue.close()
    return 0


def _serve(args: argparse.Namespace) -> int:
    import signal

    import uvicorn

    from .app import create_app
    from .auth import KeyFileError, KeyRing
    from .bootstrap import build_components

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _set_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = ServerConfig(
        data_dir=args.data_dir,
        model=args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        admin_key=args.admin_key,
        api_keys_file=args.api_keys_file,
        device=args.device,
        engine=args.engine,
        batch_window_s=args.batch_window_ms / 1000,
        max_batch_size=args.max_batch_size,
        max_batched_tokens=args.max_batched_tokens,
        max_waiting=args.max_waiting,
        max_upload_bytes=int(args.max_upload_mb * 2**20),
        max_request_bytes=int(args.max_request_mb * 2**20),
        max_loaded_skills=args.max_loaded_skills,
        prefix_cache_tokens=args.prefix_cache_tokens,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix,
        run_trainer=not args.no_trainer,
        router=_router_settings(args),
    )
    try:
        keys = KeyRing.from_config(cfg)  # before the model loads: a bad keys file stops the start at once
    except KeyFileError as e:
        raise SystemExit(f"skillpool serve: {e}") from None
    signal.signal(signal.SIGHUP, lambda *_: keys.reload())  # uvicorn handles SIGINT and SIGTERM, not this one
    components = build_components(cfg)
    app = create_app(components, keys)
    print(
        f"skillpool: serving {components.base.model_id} with {len(components.pool.records())} skill(s) on http://{cfg.host}:{cfg.port}",
        file=sys.stderr,
        flush=True,
    )
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=args.log_level.lower())
    finally:
        components.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="skillpool", description="An OpenAI-compatible server over a growing pool of LoRA skills"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _worker_parser(sub)
    from skillpool.evaluation.upload import add_arguments as upload_arguments

    upload_arguments(
        sub.add_parser("upload", help="upload a task file to a running server and follow the training job")
    )
    ev = sub.add_parser("eval", help="benchmarks that are part of the product").add_subparsers(
        dest="what", required=True
    )
    from skillpool.evaluation.routing import add_arguments as routing_arguments

    routing_arguments(
        ev.add_parser("routing", help="learn tasks one by one into a fresh router and measure routing after each")
    )
    from skillpool.evaluation.continual import add_arguments as continual_arguments

    continual_help = "learn a task sequence through the server; score matrix, AP, F.Ra, FWT, BWT, baselines"
    continual_arguments(ev.add_parser("continual", help=continual_help))
    args = parser.parse_args(argv)
    if args.command == "eval" and args.what == "routing":
        from skillpool.evaluation.routing import run as run_routing

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        run_routing(args)
        return 0
    if args.command == "eval" and args.what == "continual":
        from skillpool.evaluation.continual import run as run_continual

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        run_continual(args)
        return 0
    if args.command == "upload":
        from skillpool.evaluation.upload import run as run_upload

        return run_upload(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "worker":
        return _worker(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
