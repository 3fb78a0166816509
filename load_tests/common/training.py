"""A measurement taken while a skill trains in the same server, for the benchmarks that compare serving beside
training with serving alone."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from skillpool.evaluation.tasks_client import TasksClient
from skillpool.trainer.records import TERMINAL

T = TypeVar("T")


def while_training(
    url: str, body: bytes, measure: Callable[[], T], config: dict[str, Any] | None = None, timeout_s: float = 600
) -> tuple[T, bool]:
    """`measure()` once an upload of `body` trains in the server at `url` (its first optimizer step done: past the
    job's setup), then the job is cancelled and waited for. Also returns whether the job was still training when the
    measurement ended (if not, part of it saw an idle server)."""
    tasks = TasksClient(url)
    job_id = tasks.upload("sst-2", body, config=config or {"epochs": 3})["id"]
    deadline = time.monotonic() + timeout_s
    while (job := tasks.job(job_id))["status"] not in TERMINAL and not (job["progress"].get("step") or 0) >= 1:
        if time.monotonic() > deadline:
            raise SystemExit(f"the training job made no step in {timeout_s:.0f} s")
        time.sleep(0.2)
    if job["status"] in TERMINAL:
        raise SystemExit(f"the training job ended ({job['status']}) before it could be measured against")
    try:
        out = measure()
        still = tasks.job(job_id)["status"] == "running"
    finally:
        tasks.cancel(job_id)
        tasks.wait_for(job_id, TERMINAL)
    return out, still
