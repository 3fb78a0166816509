"""Helpers shared by the load and acceptance scripts: dataset rows (from the folder SKILLPOOL_DATASETS names),
uploads, concurrent chat calls."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from pathlib import Path
from typing import Any

import httpx

from skillpool.evaluation.tasks import DATASETS_SETTING, dataset_folder, datasets_root, task_lines, task_text


def datasets() -> Path:
    """The benchmark datasets folder SKILLPOOL_DATASETS names; stops the script with that message when unset."""
    root = datasets_root()
    if root is None:
        raise SystemExit(f"{DATASETS_SETTING} is not set: point it at the benchmark datasets folder (GROUP/TASK/)")
    return root


def rows(group: str, task: str, split: str, n: int | None = None) -> list[dict[str, Any]]:
    """The first n rows (all: None) of GROUP/TASK/SPLIT.jsonl under SKILLPOOL_DATASETS; stops the script when the
    setting or the task is missing."""
    try:
        folder = dataset_folder(group, task)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    lines = task_lines(folder, split)
    return [json.loads(x) for x in (lines[:n] if n else lines)]


def status_kib(pid: int, field: str) -> int:
    """A kB field of /proc/PID/status: VmRSS (resident now), VmHWM (the most it has held)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def user_text(row: dict[str, Any]) -> str:
    """What a chat user sends for a benchmark row: instruction + input, as the router is evaluated."""
    return task_text(row, "with-instruction")


def upload(
    url: str, name: str, body: bytes, config: dict[str, Any] | None = None, force: bool = False
) -> httpx.Response:
    data = {"name": name, "config": json.dumps(config or {}), "force": str(force).lower()}
    return httpx.post(url + "/tasks", files={"file": (f"{name}.jsonl", body)}, data=data, timeout=120)


def wait_job(url: str, job_id: str, timeout_s: float = 3600, poll_s: float = 5, verbose: bool = True) -> dict[str, Any]:
    deadline = time.time() + timeout_s
    last = -1
    while time.time() < deadline:
        job = httpx.get(f"{url}/tasks/{job_id}", timeout=30).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        p = job["progress"]
        if verbose and p.get("step") != last and p.get("total"):
            last = p["step"]
            eta = p.get("eta_s")
            print(
                f"  {job['skill']}: step {p['step']}/{p['total']} loss {p.get('loss') or 0:.3f} "
                f"{p.get('tokens_per_s') or 0:.0f} tok/s eta {eta or 0:.0f}s",
                flush=True,
            )
        time.sleep(poll_s)
    raise TimeoutError(f"job {job_id} still running after {timeout_s}s")


def ask(client: Any, model: str, texts: list[str], max_tokens: int = 8, concurrency: int = 8) -> list[tuple[str, str]]:
    """(answer, x-skillpool-route header) per text, sent concurrently so the server batches them."""

    def one(text: str) -> tuple[str, str]:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=max_tokens
        )
        return raw.parse().choices[0].message.content or "", raw.headers.get("x-skillpool-route", "")

    with cf.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, texts))
