"""Command-line side of training jobs: upload a task file to a running server and follow the job with a
progress bar (step, loss, tokens/s, ETA) until it ends."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skillpool.trainer.records import TERMINAL, JobStatus


class FollowError(RuntimeError):
    """The job's status could not be read: the server refused (4xx), did not answer for `patience_s`, or exited."""


def follow(
    url: str,
    job_id: str,
    label: str,
    headers: dict[str, str] | None = None,
    poll_s: float = 2.0,
    timeout_s: float = 30.0,
    patience_s: float = 300.0,
    gone: Callable[[], str | None] | None = None,
) -> dict[str, Any]:
    """Poll GET /tasks/{id}, drawing a tqdm bar, until the job reaches a terminal state; return the job.

    A poll that times out, cannot connect or gets a 5xx is retried until `patience_s` pass with no answer:
    the job goes on in its worker either way (with Redis a restarted server takes it up again), so a server
    restart, a proxy's 502 or a slow answer from a busy machine must not end the command that waits for it.
    `gone`, where the caller runs the server itself, says why it exited (None while it runs): then a failed
    poll ends at once instead of waiting out the patience.
    """
    import httpx
    from tqdm import tqdm

    bar = tqdm(desc=label, unit="step", dynamic_ncols=True)
    last_answer = time.monotonic()
    try:
        while True:
            try:
                r = httpx.get(f"{url}/tasks/{job_id}", headers=headers, timeout=timeout_s)
                if r.status_code >= 500:
                    raise httpx.HTTPStatusError(f"{r.status_code} {r.text[:200]}", request=r.request, response=r)
            except (httpx.TransportError, httpx.HTTPStatusError) as e:
                if gone is not None and (why := gone()) is not None:
                    raise FollowError(f"job {job_id}: {why}") from e
                waited = time.monotonic() - last_answer
                if waited >= patience_s:
                    raise FollowError(f"{url} gave no status for job {job_id} for {waited:.0f}s: {e!r}") from e
                bar.write(f"polling {job_id} failed ({e!r}); retrying for up to {patience_s - waited:.0f}s more")
                time.sleep(poll_s)
                continue
            last_answer = time.monotonic()
            if r.status_code != 200:
                raise FollowError(f"GET /tasks/{job_id} refused ({r.status_code}): {r.text}")
            job: dict[str, Any] = r.json()
            p = job.get("progress") or {}
            if p.get("total"):
                bar.total, bar.n = p["total"], p.get("step") or 0
                bar.set_postfix(
                    loss=f"{p.get('loss') or 0:.3f}", tok_s=f"{p.get('tokens_per_s') or 0:.0f}", refresh=False
                )
                bar.refresh()
            if job["status"] in TERMINAL:
                return job
            time.sleep(poll_s)
    finally:
        bar.close()


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
    data = {
        "name": args.name,
        "config": args.config,
        "force": str(args.force).lower(),
        "new_version": str(args.new_version).lower(),
    }
    if args.method:
        data["method"] = args.method
    return send_and_follow(args, "/tasks", {"file": (args.file.name, args.file.read_bytes())}, data, "upload")


def send_and_follow(args: argparse.Namespace, path: str, files: dict[str, Any], data: dict[str, str], what: str) -> int:
    """POST a request that creates a job (`args`: url, api_key, name, no_wait), then follow the job; exit 0 only if
    it succeeded (or --no-wait). A refusal prints the server's message."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    r = httpx.post(f"{args.url}{path}", files=files, data=data, headers=headers, timeout=300)
    if r.status_code != 202:
        print(f"{what} refused ({r.status_code}): {r.text}", file=sys.stderr)
        return 1
    job = r.json()
    if not args.no_wait:
        try:
            job = follow(args.url, job["id"], f"{args.name} ({job['method']})", headers)
        except FollowError as e:
            print(str(e), file=sys.stderr)
            return 1
    print(json.dumps(job, indent=2))
    return 0 if args.no_wait or job["status"] == JobStatus.SUCCEEDED else 1
