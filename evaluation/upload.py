"""`skillpool upload`: upload a task file to a running server and follow the job with a progress bar (step, loss,
tokens/s, ETA) until it ends (the client: tasks_client.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skillpool.trainer.records import JobStatus

from .tasks_client import FollowError, TasksClient, UploadRefused


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, help="JSONL task file (chat or instruction format)")
    p.add_argument("--name", required=True, help="skill name")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--method", default=None, help="isolated | sapt | kif (default: the server's)")
    p.add_argument("--config", default="{}", help="training hyperparameters (JSON)")
    p.add_argument("--force", action="store_true", help="register even if the quality gate fails")
    p.add_argument("--new-version", action="store_true", help="train a new version of a skill that exists")
    p.add_argument("--api-key", default=None, help="a key with role train or admin, when the server has keys")
    p.add_argument("--no-wait", action="store_true", help="print the job and return at once")


def run(args: argparse.Namespace) -> int:
    """Upload, then follow; exit 0 only if the job succeeded. Errors print the server's message."""
    return submit_and_follow(
        args,
        lambda client: client.upload(
            args.name,
            args.file.read_bytes(),
            filename=args.file.name,
            method=args.method,
            config=args.config,
            force=args.force,
            new_version=args.new_version,
        ),
    )


def submit_and_follow(args: argparse.Namespace, submit: Callable[[TasksClient], dict[str, Any]]) -> int:
    """Create a job with `submit` (`args`: url, api_key, name, no_wait), follow it unless --no-wait, print it; exit 0
    only if it succeeded (or --no-wait). A refusal or a lost job prints the server's message and exits 1."""
    client = TasksClient(args.url, args.api_key)
    try:
        job = submit(client)
        if not args.no_wait:
            job = client.follow(job["id"], f"{args.name} ({job['method']})")
    except (UploadRefused, FollowError) as e:
        print(str(e), file=sys.stderr)
        return 1
    print(json.dumps(job, indent=2))
    return 0 if args.no_wait or job["status"] == JobStatus.SUCCEEDED else 1
