"""`skillpool serve`: its flags and its run (the console script, skillpool.cli.main, dispatches here)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from skillpool.router.flags import add_router_flags, router_settings
from skillpool.trainer.threads import add_threads_argument, set_threads

from .config import ServerConfig
from .engines import ENGINES


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
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
    add_threads_argument(p)
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
    add_router_flags(p)
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


def run(args: argparse.Namespace) -> int:
    import signal

    import uvicorn

    from .app import create_app
    from .auth import KeyFileError, KeyRing
    from .bootstrap import build_components

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    set_threads(args.threads)
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
        router=router_settings(args),
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
