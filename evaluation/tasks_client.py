"""The one client of a server's `/tasks` API: upload a task file, follow its job (with a progress bar, or quietly),
wait for a state, cancel. `skillpool upload`, `skillpool eval continual`, the benchmarks and the end-to-end tests
all go through it, so the endpoint's form fields and the job's states are spelled in one place."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from typing import Any

import httpx

from skillpool.trainer.records import TERMINAL


class FollowError(RuntimeError):
    """The job's status could not be read: the server refused (4xx), did not answer for `patience_s`, or exited."""


class UploadRefused(RuntimeError):
    """A request that creates a job (an upload, an import) answered other than 202; `response` holds the answer."""

    def __init__(self, name: str, response: httpx.Response, what: str = "upload") -> None:
        self.response = response
        super().__init__(f"{what} of {name} refused ({response.status_code}): {response.text}")


class TasksClient:
    """A server's `/tasks` endpoints at `url` (no `/v1`), with a bearer key where the server has keys. `timeout_s`
    bounds a poll, `upload_timeout_s` an upload (a large file to a busy server)."""

    def __init__(
        self, url: str, api_key: str | None = None, timeout_s: float = 30.0, upload_timeout_s: float = 300.0
    ) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s, self.upload_timeout_s = timeout_s, upload_timeout_s

    def submit(
        self,
        name: str,
        body: bytes,
        *,
        filename: str | None = None,
        method: str | None = None,
        config: dict[str, Any] | str | None = None,
        force: bool = False,
        new_version: bool = False,
    ) -> httpx.Response:
        """POST /tasks as is: the caller reads the status (a test of a refusal wants the 4xx)."""
        data = {
            "name": name,
            "config": config if isinstance(config, str) else json.dumps(config or {}),
            "force": str(force).lower(),
            "new_version": str(new_version).lower(),
        }
        if method:
            data["method"] = method
        files = {"file": (filename or f"{name}.jsonl", body)}
        return httpx.post(
            f"{self.url}/tasks", files=files, data=data, headers=self.headers, timeout=self.upload_timeout_s
        )

    def upload(self, name: str, body: bytes, **fields: Any) -> dict[str, Any]:
        """`submit`, and the queued job's record; UploadRefused unless the server took it (202)."""
        r = self.submit(name, body, **fields)
        if r.status_code != 202:
            raise UploadRefused(name, r)
        job: dict[str, Any] = r.json()
        return job

    def import_adapter(
        self, name: str, adapter_tar: bytes, examples: bytes, *, force: bool = False, new_version: bool = False
    ) -> dict[str, Any]:
        """POST /v1/skills/import (a PEFT folder as a tar, the examples as JSONL): the import job's record, followed
        at /tasks/{id} like a training job's; UploadRefused unless the server took it."""
        data = {"name": name, "force": str(force).lower(), "new_version": str(new_version).lower()}
        files = {"adapter": (f"{name}.tar.gz", adapter_tar), "examples": (f"{name}.jsonl", examples)}
        r = httpx.post(
            f"{self.url}/v1/skills/import", files=files, data=data, headers=self.headers, timeout=self.upload_timeout_s
        )
        if r.status_code != 202:
            raise UploadRefused(name, r, "import")
        job: dict[str, Any] = r.json()
        return job

    def job(self, job_id: str) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/tasks/{job_id}", headers=self.headers, timeout=self.timeout_s)
        r.raise_for_status()
        job: dict[str, Any] = r.json()
        return job

    def jobs(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/tasks", headers=self.headers, timeout=self.timeout_s)
        jobs: list[dict[str, Any]] = r.raise_for_status().json()["data"]
        return jobs

    def cancel(self, job_id: str) -> httpx.Response:
        return httpx.delete(f"{self.url}/tasks/{job_id}", headers=self.headers, timeout=self.timeout_s)

    def wait_for(
        self, job_id: str, statuses: Collection[str], timeout_s: float = 600.0, poll_s: float = 0.5
    ) -> dict[str, Any]:
        """Poll until the job's status is one of `statuses` (or terminal: a job that ended will not change)."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job["status"] in statuses or job["status"] in TERMINAL:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['status']} after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def follow(
        self,
        job_id: str,
        label: str | None = None,
        *,
        progress: bool = True,
        poll_s: float = 2.0,
        patience_s: float = 300.0,
        gone: Callable[[], str | None] | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Poll GET /tasks/{id} until the job reaches a terminal state, drawing a tqdm bar (step, loss, tokens/s)
        unless `progress` is off; return the job. TimeoutError once `timeout_s` pass (None: wait for as long as it
        trains).

        A poll that times out, cannot connect or gets a 5xx is retried until `patience_s` pass with no answer:
        the job goes on in its worker either way (with Redis a restarted server takes it up again), so a server
        restart, a proxy's 502 or a slow answer from a busy machine must not end the command that waits for it.
        `gone`, where the caller runs the server itself, says why it exited (None while it runs): then a failed
        poll ends at once instead of waiting out the patience.
        """
        from tqdm import tqdm

        bar = tqdm(desc=label or job_id, unit="step", dynamic_ncols=True, disable=not progress)
        last_answer = time.monotonic()
        deadline = None if timeout_s is None else last_answer + timeout_s
        try:
            while True:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} did not end within {timeout_s:.0f} s")
                try:
                    r = httpx.get(f"{self.url}/tasks/{job_id}", headers=self.headers, timeout=self.timeout_s)
                    if r.status_code >= 500:
                        raise httpx.HTTPStatusError(f"{r.status_code} {r.text[:200]}", request=r.request, response=r)
                except (httpx.TransportError, httpx.HTTPStatusError) as e:
                    if gone is not None and (why := gone()) is not None:
                        raise FollowError(f"job {job_id}: {why}") from e
                    waited = time.monotonic() - last_answer
                    if waited >= patience_s:
                        raise FollowError(f"{self.url} gave no status for job {job_id} for {waited:.0f}s: {e!r}") from e
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

    def train(
        self, name: str, body: bytes, label: str | None = None, progress: bool = True, **fields: Any
    ) -> dict[str, Any]:
        """Upload and follow to the end: the job's last record (its status says whether the skill registered)."""
        job = self.upload(name, body, **fields)
        return self.follow(job["id"], label or f"{name} ({job['method']})", progress=progress)
