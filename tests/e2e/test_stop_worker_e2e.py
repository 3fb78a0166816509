"""`skillpool worker` stopped with SIGTERM while it trains (a private redis-server, the tiny LLaMA as its base model):
its job goes back to the front of the queue at once (no lease to wait out), its scratch is removed, it exits 0 within
the timeout and no process of its tree is alive 10 s later. A worker killed with SIGKILL leaves its job to the
lease: tests/e2e/test_worker_killed_e2e.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from skillpool.trainer.config import TrainConfig
from skillpool.trainer.jobs.job import Job, new_job_id
from skillpool.trainer.jobs.redis_queue import RedisJobQueue
from tests.conftest import start_redis, until
from tests.datasets import read_task
from tests.e2e.stopping import assert_all_gone, exits, tree

pytestmark = pytest.mark.slow
TIMEOUT_S = 20.0


def test_sigterm_gives_the_running_job_back_and_nothing_outlives_the_worker(tiny_base: Any, tmp_path: Path) -> None:
    examples = read_task("long_sequence", "sst-2", "train", 40)
    redis_proc, url = start_redis(tmp_path / "redis")
    data = tmp_path / "data"
    queue = RedisJobQueue(url, None)  # what a server does on an upload: enqueue only
    worker = None
    try:
        job = Job(id=new_job_id(), skill="sst-2", method="isolated", config={}, force=True)
        queue.submit(queue.add(job), examples, TrainConfig(epochs=100))
        cmd = [sys.executable, "-m", "skillpool.cli.main", "worker", "--redis-url", url, "--data-dir", str(data)]
        cmd += ["--model", str(tiny_base.path), "--shutdown-timeout", f"{TIMEOUT_S:g}"]
        with (tmp_path / "worker.log").open("ab") as log:
            worker = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
            )

        def record() -> Job:
            got = queue.get(job.id)
            assert got is not None
            return got

        until(lambda: record().status == "running" and (record().progress["step"] or 0) >= 2, timeout=300)
        procs = tree(worker.pid)
        worker.send_signal(signal.SIGTERM)
        assert exits(worker, TIMEOUT_S + 10) == 0, (tmp_path / "worker.log").read_text()[-3000:]

        back = record()
        assert back.status == "queued" and back.tries == 1, back
        assert queue.r.lrange(queue.keys.queue, 0, -1) == [job.id]  # no lease to wait out: queued again at once
        assert queue.r.llen(queue.keys.processing) == 0
        assert list((data / "tmp").iterdir()) == []  # its scratch went with the stopped job
        assert not (data / "skills" / "sst-2").exists() or not any((data / "skills" / "sst-2").glob("v*"))
        assert_all_gone(procs)
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()
        queue.close()
        redis_proc.terminate()
        redis_proc.wait(timeout=10)
