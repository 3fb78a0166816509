"""Faults in the job queues: a full disk or any error ends the job (in memory at once, on disk once it can be
written), never the worker thread; job creation into a full disk leaves no phantom job; a skill name is reserved
atomically by one job at a time, in process and across servers (Redis)."""

from __future__ import annotations

import errno
import json
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from skillpool.adapters_store.diskio import StorageError
from skillpool.adapters_store.store import SkillDraft, SkillRecord, SkillStore
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.jobs import local_queue
from skillpool.trainer.jobs.failures import describe
from skillpool.trainer.jobs.job import Job, new_job_id
from skillpool.trainer.jobs.local_queue import LocalJobQueue
from skillpool.trainer.jobs.redis_queue import RedisJobQueue
from skillpool.trainer.records import TERMINAL, JobStatus
from tests.conftest import until
from tests.disk import fill, small_tmpfs, temp_leftovers

CFG = TrainConfig()


def _job(skill: str = "s") -> Job:
    return Job(id=new_job_id(), skill=skill, method="isolated", config={})


def _draft(name: str) -> SkillDraft:
    def write(folder: Path) -> None:
        (folder / "adapter_config.json").write_text("{}")
        (folder / "adapter_model.safetensors").write_bytes(b"\0" * 64)

    return SkillDraft(name, write, {"k": torch.zeros(4)}, {}, [], [])


def _storing(store: SkillStore, before: Callable[[], None] = lambda: None) -> Any:
    """A runner that writes a (tiny) skill version into the real store, after `before()`."""

    def run(job: Job, *_: Any) -> SkillRecord:
        before()
        return store.write(_draft(job.skill))

    return run


def _on_disk(q: LocalJobQueue, job: Job) -> dict[str, Any]:
    return dict(json.loads((q.dir / f"{job.id}.json").read_text()))


def test_a_full_disk_fails_the_job_not_the_worker_and_the_record_follows(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(local_queue, "RETRY_SAVE_S", 0.2)
    with small_tmpfs(tmp_path / "data", "2m") as data:
        store = SkillStore(data)
        ballast: list[Path] = []
        q = LocalJobQueue(data / "jobs", _storing(store, lambda: ballast.append(fill(data))), lambda _: None)
        try:
            # the runner fills the disk, then the store write fails, then the job's own record cannot be written
            job = q.submit(_job("first"), [], CFG)
            until(lambda: job.status in TERMINAL)
            assert job.status == JobStatus.FAILED and job.error_code == "insufficient_storage"
            assert job.error is not None and "no space left on device" in job.error and str(data) not in job.error
            assert q.trainer_alive() and q.unsaved() == {job.id}
            assert _on_disk(q, job)["status"] == "running"  # not yet: the disk is full

            # creating a job into the full disk: an error, and no trace of the job anywhere
            lost = _job("second")
            with pytest.raises(StorageError):
                q.submit(lost, [], CFG)
            assert q.get(lost.id) is None and lost.id not in {j.id for j in q.list()} and q.depth() == 0
            assert lost.events == []  # as it was before submit
            assert temp_leftovers(data) == [] and sorted(p.name for p in (data / "jobs").iterdir()) == [
                f"{job.id}.json"
            ]

            # space again: the idle worker writes the failed record, and the next job trains
            ballast.pop().unlink()
            until(lambda: _on_disk(q, job)["status"] == "failed", timeout=10)
            assert _on_disk(q, job)["error_code"] == "insufficient_storage" and q.unsaved() == set()
            q.runner = _storing(store)
            ok = q.submit(_job("first"), [], CFG)
            until(lambda: ok.status in TERMINAL)
            assert ok.status == JobStatus.SUCCEEDED and ok.skill_version == 1 and q.trainer_alive()
            assert temp_leftovers(data) == []
        finally:
            q.close()


def test_any_error_around_a_job_ends_the_job_and_the_worker_takes_the_next(tmp_path: Path) -> None:
    def register(rec: SkillRecord) -> None:
        if rec.name == "bad":
            raise RuntimeError(f"cannot read {tmp_path}/skills/bad/v1/meta.json")

    def count(job: Job) -> None:
        raise ValueError("a metrics callback that breaks")

    store = SkillStore(tmp_path)
    q = LocalJobQueue(tmp_path / "jobs", _storing(store), register, on_finish=count)
    try:
        bad, good = q.submit(_job("bad"), [], CFG), q.submit(_job("good"), [], CFG)
        until(lambda: good.status in TERMINAL)
        assert bad.status == JobStatus.FAILED and bad.error_code == "not_registered"
        assert bad.error is not None and "meta.json" in bad.error and str(tmp_path) not in bad.error  # no paths
        assert good.status == JobStatus.SUCCEEDED and q.trainer_alive()
    finally:
        q.close()


def test_start_up_sweeps_cut_short_writes_and_fails_unfinished_jobs(tmp_path: Path) -> None:
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    running = _job()
    running.status = JobStatus.RUNNING
    (jobs_dir / f"{running.id}.json").write_text(json.dumps(running.to_dict()))
    (jobs_dir / f".{running.id}.json.tmp").write_text("")  # an old-style temp file a full disk left empty
    q = LocalJobQueue(jobs_dir, _storing(SkillStore(tmp_path)), lambda _: None)
    try:
        assert sorted(p.name for p in jobs_dir.iterdir()) == [f"{running.id}.json"]
        assert _on_disk(q, running)["status"] == "failed" and _on_disk(q, running)["error_code"] == "server_restarted"
    finally:
        q.close()


def _race(reserve: Callable[[Job], str | None], skill: str, n: int = 16) -> tuple[list[Job], list[str | None]]:
    """n threads reserve `skill` for n new jobs at the same moment."""
    jobs = [_job(skill) for _ in range(n)]
    start = threading.Barrier(n)

    def one(job: Job) -> str | None:
        start.wait()
        return reserve(job)

    with ThreadPoolExecutor(n) as pool:
        return jobs, list(pool.map(one, jobs))


def test_one_job_at_a_time_holds_a_skill_name_in_process(tmp_path: Path) -> None:
    gate = threading.Event()
    q = LocalJobQueue(tmp_path / "jobs", _storing(SkillStore(tmp_path), lambda: gate.wait(30)), lambda _: None)
    try:
        jobs, answers = _race(q.reserve, "new")
        winners = [j for j, a in zip(jobs, answers) if a is None]
        assert len(winners) == 1 and set(answers) == {None, winners[0].id}
        q.submit(winners[0], [], CFG)
        until(lambda: winners[0].status == JobStatus.RUNNING)
        assert q.reserve(_job("new")) == winners[0].id  # held while it runs
        assert q.reserve(_job("other")) is None  # other names are free
        gate.set()
        until(lambda: winners[0].status in TERMINAL)
        assert q.reserve(later := _job("new")) is None  # the job ended: the name is free again
        q.release(later)  # never recorded (its creation failed): released by hand
        assert q.reserve(_job("new")) is None
    finally:
        gate.set()
        q.close()


def test_one_job_at_a_time_holds_a_skill_name_across_servers(redis_url: str) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    a, b = RedisJobQueue(redis_url, None, prefix=prefix), RedisJobQueue(redis_url, None, prefix=prefix)
    try:
        servers = [a, b]
        jobs, answers = _race(lambda j: servers[int(j.id[-1], 16) % 2].reserve(j), "new")
        winners = [j for j, x in zip(jobs, answers) if x is None]
        assert len(winners) == 1 and set(answers) == {None, winners[0].id}
        key = a.keys.skill("new")
        assert a.r.pttl(key) > 0  # not recorded yet: a server that dies now frees the name by itself
        a.submit(winners[0], [], CFG)
        assert a.r.pttl(key) == -1 and b.reserve(_job("new")) == winners[0].id
        assert b.cancel(winners[0].id) is not None  # still queued (no worker): cancelled at once
        assert a.r.get(key) is None and b.reserve(fresh := _job("new")) is None
        b.add(fresh)
        fresh.finish(JobStatus.FAILED, "validation failed")
        a.r.set(a.keys.job(fresh.id), json.dumps(fresh.to_dict()))  # ended, but its name was never released
        assert a.reserve(_job("new")) is None  # a holder that has ended is replaced
    finally:
        a.close()
        b.close()


def test_the_redis_worker_survives_any_error_in_a_job(redis_url: str, tmp_path: Path) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    server = RedisJobQueue(redis_url, None, prefix=prefix)
    broken = _job("broken")
    server.submit(broken, [], CFG)
    server.r.set(server.keys.data(broken.id), "{not json")  # what no worker can read
    good = server.submit(_job("good"), [], CFG)
    # the worker starts after the data is broken: started first, it could claim the job before that
    worker = RedisJobQueue(redis_url, _storing(SkillStore(tmp_path)), prefix=prefix, lease_s=5)
    try:
        until(lambda: (server.get(good.id) or good).status in TERMINAL, timeout=30)
        done = server.get(broken.id)
        assert done is not None and done.status == JobStatus.FAILED and done.error_code == "training_error"
        assert (server.get(good.id) or good).status == JobStatus.SUCCEEDED
        assert worker.trainer_alive() is True and server.trainer_alive() is None
        assert server.r.get(server.keys.skill("broken")) is None
    finally:
        worker.close()
        server.close()


def test_job_errors_name_no_internal_path() -> None:
    job = _job()
    job.finish(JobStatus.FAILED, "OSError: [Errno 5] I/O error: '/srv/skillpool/data/skills/x/v3/router.safetensors'")
    assert job.error == "OSError: [Errno 5] I/O error: 'router.safetensors'"
    assert "/srv" not in job.events[-1]["message"]
    job.finish(JobStatus.FAILED, "quality gate: new skill scores 0.20/0.50 on N/A rows")  # no path: unchanged
    assert job.error == "quality gate: new skill scores 0.20/0.50 on N/A rows"
    assert describe(RuntimeError("x")) == ("training_error", "RuntimeError: x")
    assert describe(OSError(errno.EDQUOT, "Disk quota exceeded"))[0] == "insufficient_storage"
    try:  # safetensors says it in its message only; torch chains the OSError
        raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
    except RuntimeError as e:
        assert describe(e) == (
            "insufficient_storage",
            "no space left on device (disk full or quota reached) while saving the skill",
        )
