"""A `skillpool worker` SIGKILLed mid-job: a second worker on the same Redis finishes the job after the lease
expires, one skill version is written, and the server (which only enqueues) serves the skill.

Real processes throughout: a private redis-server, `skillpool serve --no-trainer`, two `skillpool worker`s
(the tiny LLaMA as their base model, so training takes seconds), and the openai client for the chat."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from skillpool.evaluation.process import ServerProcess
from tests.conftest import start_redis, until
from tests.datasets import sst2_lines

pytestmark = pytest.mark.slow
LEASE_S = 3


def _worker(redis_url: str, data_dir: Path, model: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "skillpool.cli.main", "worker", "--redis-url", redis_url, "--data-dir"]
    cmd += [str(data_dir), "--model", str(model), "--lease-s", str(LEASE_S), "--max-tries", "3"]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_a_killed_worker_s_job_is_finished_by_another_and_served(tiny_base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    redis_proc, url = start_redis(tmp_path / "redis")
    data = tmp_path / "data"
    workers: list[subprocess.Popen[bytes]] = []
    try:
        with ServerProcess(
            data, ["--redis-url", url, "--no-trainer", "--model", str(tiny_base.path), "--default-max-tokens", "4"]
        ) as srv:
            workers.append(_worker(url, data, tiny_base.path, tmp_path / "worker1.log"))
            r = httpx.post(  # forced: a random tiny model cannot pass the quality gate
                srv.url + "/tasks",
                files={"file": ("sst-2.jsonl", sst2_lines(40))},
                data={"name": "sst-2", "config": json.dumps({"epochs": 30}), "force": "true"},
                timeout=120,
            )
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]

            def job() -> dict:  # type: ignore[type-arg]
                return httpx.get(f"{srv.url}/tasks/{job_id}", timeout=10).json()

            # kill it while it trains: running, some steps done, nothing stored yet
            until(lambda: job()["status"] == "running" and (job()["progress"]["step"] or 0) >= 2, timeout=300)
            workers[0].send_signal(signal.SIGKILL)
            workers[0].wait()
            assert job()["status"] == "running"  # nobody ended it: only the lease can tell
            assert any((data / "tmp").iterdir())  # its scratch, in the data dir: swept by the next worker's start
            assert not (data / "skills" / "sst-2").exists() or not any((data / "skills" / "sst-2").glob("v*"))

            workers.append(_worker(url, data, tiny_base.path, tmp_path / "worker2.log"))
            until(lambda: job()["status"] in ("succeeded", "failed", "cancelled"), timeout=600)
            done = job()
            assert done["status"] == "succeeded", (done["error"], (tmp_path / "worker2.log").read_text()[-3000:])
            assert done["tries"] == 2 and done["skill_version"] == 1
            assert any("try 2 of 3" in e["message"] for e in done["events"])
            assert sorted(p.name for p in (data / "skills" / "sst-2").glob("v*")) == ["v1"]
            assert list((data / "tmp").iterdir()) == []  # the killed worker's scratch went at the next start

            # the server heard of it through the events stream and serves it
            from openai import OpenAI

            client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            until(lambda: "sst-2" in [m.id for m in client.models.list().data], timeout=30)
            answer = client.chat.completions.create(
                model="sst-2", messages=[{"role": "user", "content": "a gorgeous, witty film"}], max_tokens=4
            )
            assert answer.choices[0].finish_reason in ("stop", "length")
            assert httpx.get(f"{srv.url}/metrics", timeout=10).status_code == 200
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()
                w.wait(30)
        redis_proc.terminate()
        redis_proc.wait(timeout=10)
