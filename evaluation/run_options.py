"""The options and the result's config block that `eval continual` and `eval answers` share: both train each
task's skill through a `skillpool serve` they start and ask it, so one place owns how such a run is set up.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from skillpool.trainer.config import METHODS, ConfigError, TrainConfig

METRICS = ("auto", "exact_match", "rouge_l")


def add_server_run_flags(
    p: argparse.ArgumentParser, train_limit: int | None, test_limit: int | None, config_help: str
) -> None:
    """The training, asking and server flags; a limit of None reads every row (its help says so)."""
    every = " (default: all)"
    p.add_argument("--method", choices=METHODS, default="isolated")
    p.add_argument(
        "--train-limit",
        type=int,
        default=train_limit,
        help="first N training rows per task" + every * (train_limit is None),
    )
    p.add_argument(
        "--test-limit", type=int, default=test_limit, help="first N test rows per task" + every * (test_limit is None)
    )
    p.add_argument("--config", default="{}", help=config_help)
    p.add_argument(
        "--metric", choices=METRICS, default="auto", help="auto: exact match for label tasks, ROUGE-L otherwise"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="cap on the answer length (each task: its longest answer + 8)"
    )
    p.add_argument("--router-mode", default=None, help="default: sapt for --method sapt, else dtkr")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--force", action="store_true", help="register skills even when the quality gate fails")
    p.add_argument("--data-dir", type=Path, default=None, help="the server's data dir (default: a fresh temp dir)")
    p.add_argument("--model", type=Path, default=None, help="local base checkpoint (default: the packaged SmolLM2)")
    p.add_argument(
        "--server-args",
        default="",
        help="more flags for the server it starts, e.g. --server-args='--max-batch-size 64 --max-batched-tokens 16384'"
        " on a GPU (the '=' keeps them one value)",
    )
    p.add_argument("--json", type=Path, required=True, help="write the results here")


def parse_server_args(text: str) -> list[str]:
    """--server-args as a list of flags, refusing the ones the run sets itself."""
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise SystemExit(f"--server-args: {e}") from None
    owned = ("--port", "--data-dir", "--router-mode", "--model")  # argparse also takes a prefix, e.g. --data
    for flag in (a.split("=")[0] for a in argv if a.startswith("--") and len(a) > 2):
        if any(o.startswith(flag) for o in owned):
            raise SystemExit(
                f"--server-args: {flag}: the run sets --port and --data-dir itself, and --router-mode and --model "
                "through its own options of those names"
            )
    return argv


def parse_server_run_flags(args: argparse.Namespace) -> None:
    """args.train_config from --config and args.server_argv from --server-args; a bad one stops the run."""
    try:
        args.train_config = TrainConfig.from_dict(json.loads(args.config))
    except (json.JSONDecodeError, ConfigError) as e:
        raise SystemExit(f"--config: {e}") from None
    args.server_argv = parse_server_args(args.server_args)


def training_setup(args: argparse.Namespace) -> dict[str, Any]:
    """How each task was trained and asked: what two runs must share for their scores to be compared."""
    return {
        "method": args.method,
        "train_limit": args.train_limit,
        "test_limit": args.test_limit,
        "train_config": args.train_config.to_dict(),
        "metric": args.metric,
        "max_new_tokens": args.max_new_tokens,
    }


def run_config(args: argparse.Namespace, model_id: str, data_dir: Path) -> dict[str, Any]:
    """The result's record of how the run was set up (what --reference compares against)."""
    return {
        "tasks": [str(p) for p in args.tasks],
        **training_setup(args),
        "model": model_id,
        "force": args.force,
        "data_dir": str(data_dir),
        "server_args": args.server_args,
    }


def write_json(path: Path, result: dict[str, Any]) -> None:
    """A command's result as indented JSON at `path` (its folder made), the one format every `eval` writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
