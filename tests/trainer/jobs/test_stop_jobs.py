"""A stopping process stops its training cleanly: in process, the running job (a real SkillTrainer on the tiny
LLaMA) ends `failed` with `server_stopped`, queued ones too, its scratch is gone and nothing is stored; on Redis, the
running job goes back to the front of the queue under its lease rules and the next worker finishes it; a job its
owner cancelled stays cancelled."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import redis

from skillpool.adapters_store.store import SkillRecord, SkillStore
from skillpool.router import Router
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.jobs.job import Job, new_job_id
from skillpool.trainer.jobs.local_queue import LocalJobQueue
from skillpool.trainer.jobs.redis_queue import RedisJobQueue
from skillpool.trainer.jobs.runner import make_runner
from skillpool.trainer.loop import Cancelled
from skillpool.trainer.records import TERMINAL, JobStatus
from skillpool.trainer.skill_trainer import SkillTrainer
from tests.conftest import until
from tests.datasets import read_task


def _job(skill: str = "s") -> Job:
    return Job(id=new_job_id(), skill=skill, method="isolated", config={})


def test_closing_the_local_queue_fails_its_jobs_as_stopped_and_leaves_nothing(
    tiny_base, embedder, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    examples = read_task("long_sequence", "sst-2", "train", 60)
    trainer = SkillTrainer(SkillStore(tmp_path), Router(embedder), tiny_base)
    q = LocalJobQueue(tmp_path / "jobs", make_runner(trainer), lambda _: None)
    running = q.submit(_job("sst-2"), examples, TrainConfig(epochs=50))
    queued = q.submit(_job("other"), examples, TrainConfig())
    until(lambda: running.status == JobStatus.RUNNING and (running.progress["step"] or 0) >= 1, timeout=120)
    q.close(timeout_s=60)
    for job in (running, queued):
        assert (job.status, job.error_code) == (JobStatus.FAILED, "server_stopped"), job
        assert "server stopped" in (job.error or "")
    assert not q.trainer_alive()  # stopped on purpose: not reported as a dead trainer
    assert trainer.store.get("sst-2") is None and list(trainer.store.tmp_dir.iterdir()) == []
    # the records say so on disk: a restart reads them as they are
    again = LocalJobQueue(tmp_path / "jobs", make_runner(trainer), lambda _: None)
    try:
        assert again.get(running.id).error_code == "server_stopped"  # type: ignore[union-attr]
        late = q.submit(_job("late"), examples, TrainConfig())  # an upload that finished validating during the stop
        assert (late.status, late.error_code) == (JobStatus.FAILED, "server_stopped")
    finally:
        again.close()


def _until_stopped(started: threading.Event) -> Any:
    """A runner that trains until it is told to stop, as the training loop does (Cancelled at its next check)."""

    def runner(j: Job, _examples: Any, _cfg: Any, _progress: Any, should_stop: Any) -> SkillRecord:
        started.set()
        until(should_stop, timeout=60)
        raise Cancelled()

    return runner


def _done(j: Job, *_: Any) -> SkillRecord:
    return SkillRecord(name=j.skill, version=1, path=Path("/nonexistent"), meta={"training_job": j.id})


def test_a_stopping_redis_worker_puts_its_job_back_first_in_line(redis_url: str) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    started = threading.Event()
    enqueuer = RedisJobQueue(redis_url, None, prefix=prefix)
    worker = RedisJobQueue(redis_url, _until_stopped(started), prefix=prefix, lease_s=30)
    next_worker = None
    try:
        job = enqueuer.submit(enqueuer.add(_job()), [], TrainConfig())
        assert started.wait(20)
        other = enqueuer.submit(enqueuer.add(_job("t")), [], TrainConfig())  # queued behind it meanwhile
        worker.close(timeout_s=20)
        back = enqueuer.get(job.id)
        assert back is not None and back.status == JobStatus.QUEUED and back.tries == 1  # the start counts
        assert "back in the queue" in back.events[-1]["message"]
        assert r.lrange(enqueuer.keys.queue, 0, -1) == [job.id, other.id]  # first in line again
        assert r.llen(enqueuer.keys.processing) == 0 and not r.exists(enqueuer.keys.lease(job.id))
        assert r.exists(enqueuer.keys.data(job.id))  # its data stays for the next try
        assert worker.trainer_alive() is None  # stopped on purpose

        next_worker = RedisJobQueue(redis_url, _done, prefix=prefix, lease_s=30)
        until(lambda: (enqueuer.get(job.id) or job).status in TERMINAL, timeout=20)
        done = enqueuer.get(job.id)
        assert done is not None and done.status == JobStatus.SUCCEEDED and done.tries == 2
    finally:
        for q in (worker, next_worker, enqueuer):
            if q is not None:
                q.close()


def test_a_job_cancelled_by_its_owner_while_the_worker_stops_stays_cancelled(redis_url: str) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    started = threading.Event()
    enqueuer = RedisJobQueue(redis_url, None, prefix=prefix)
    worker = RedisJobQueue(redis_url, _until_stopped(started), prefix=prefix, lease_s=30)
    try:
        job = enqueuer.submit(enqueuer.add(_job()), [], TrainConfig())
        assert started.wait(20)
        enqueuer.cancel(job.id)
        worker.close(timeout_s=20)
        done = enqueuer.get(job.id)
        assert done is not None and done.status == JobStatus.CANCELLED and enqueuer.depth() == 0
    finally:
        worker.close()
        enqueuer.close()
