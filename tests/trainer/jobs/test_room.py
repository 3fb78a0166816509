"""Admission to both job queues, the in-process one and Redis (a real redis-server): N jobs sent at once against a
limit L, and a share per key, admit no more than fit, refuse none that fit, and a job that ends frees its place."""

from __future__ import annotations

import tempfile
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillpool.adapters_store.store import SkillRecord
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.jobs.job import Job, JobQueue, QueueFull, Room, new_job_id
from skillpool.trainer.jobs.local_queue import LocalJobQueue
from skillpool.trainer.jobs.redis_queue import RedisJobQueue
from skillpool.trainer.loop import Cancelled
from skillpool.trainer.records import TERMINAL, JobStatus
from tests.conftest import until

OWNERS = [None, "alice", "bob"]


def _held(release: threading.Event) -> Callable[..., SkillRecord]:
    """A runner that trains nothing and holds its job running until `release` or a cancel: queued jobs stay queued."""

    def runner(job: Job, examples: Any, cfg: Any, progress: Any, stop: Callable[[], bool]) -> SkillRecord:
        while not release.wait(0.05):
            if stop():
                raise Cancelled
        return SkillRecord(job.skill, 1, Path(tempfile.gettempdir()), {})

    return runner


@contextmanager
def _queue(kind: str, redis_url: str, folder: Path) -> Iterator[JobQueue]:
    if kind == "redis":  # a server that only enqueues (`--no-trainer`): its jobs wait for workers
        q: JobQueue = RedisJobQueue(redis_url, None, prefix=f"room-{uuid.uuid4().hex[:8]}")
        yield q
        q.close()
        return
    release = threading.Event()
    q = LocalJobQueue(Path(tempfile.mkdtemp(dir=folder)), _held(release), on_success=lambda rec: None)
    try:
        yield q
    finally:
        for job in q.list():  # the jobs left end without running, and the worker with them
            q.cancel(job.id)
        release.set()
        q.close()


def _job(owner: str | None) -> Job:
    return Job(id=new_job_id(), skill=f"s-{uuid.uuid4().hex[:8]}", method="isolated", config={}, owner=owner)


def _send_at_once(q: JobQueue, jobs: list[tuple[Job, str]], room: Room) -> dict[str, QueueFull | None]:
    """Each job `add`ed (as the fine-tuning API does) or `submit`ted (as /tasks does) from a thread of its own, all
    released together; job id -> the QueueFull that refused it, or None."""
    start, out = threading.Barrier(len(jobs)), {}

    def send(job: Job, how: str) -> None:
        start.wait()
        try:
            q.add(job, room) if how == "add" else q.submit(job, [], TrainConfig(), room)
            out[job.id] = None
        except QueueFull as e:
            out[job.id] = e

    threads = [threading.Thread(target=send, args=pair) for pair in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("kind", ["local", "redis"])
@given(
    limit=st.integers(1, 6),
    per_key=st.one_of(st.none(), st.integers(1, 3)),
    sent=st.lists(st.tuples(st.sampled_from(OWNERS), st.sampled_from(["add", "submit"])), min_size=1, max_size=12),
)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_jobs_sent_at_once_never_overfill_the_queue_nor_are_refused_with_room_left(
    kind: str, redis_url: str, tmp_path_factory, limit: int, per_key: int | None, sent: list[tuple[str | None, str]]
) -> None:  # type: ignore[no-untyped-def]
    room = Room(limit, per_key)
    with _queue(kind, redis_url, tmp_path_factory.getbasetemp()) as q:
        jobs = [(_job(owner), how) for owner, how in sent]
        result = _send_at_once(q, jobs, room)
        admitted = [j for j, _ in jobs if result[j.id] is None]
        mine = Counter(j.owner for j in admitted)
        assert len(admitted) <= limit and (per_key is None or max(mine.values(), default=0) <= per_key)
        for job, _ in jobs:  # admitted counts only grow: what refused a job still holds once all are in
            refused = result[job.id]
            if refused is None:
                continue
            if refused.per_key:
                assert per_key is not None and mine[job.owner] == per_key == refused.pending
            else:
                assert len(admitted) == limit == refused.pending
        recorded = {j.id for j in q.list() if j.status not in TERMINAL}
        assert recorded == {j.id for j in admitted}  # a refused job left no record behind
        assert len(admitted) == min(len(jobs), limit) or per_key is not None


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_an_ended_job_frees_its_place_and_an_added_job_keeps_its_own(kind: str, redis_url: str, tmp_path: Path) -> None:
    room = Room(2)
    with _queue(kind, redis_url, tmp_path) as q:
        validating, queued = _job("alice"), _job("bob")
        q.add(validating, room)  # a fine-tuning job: its place is taken while its files are validated
        q.submit(queued, [], TrainConfig(), room)
        with pytest.raises(QueueFull):
            q.submit(_job("carol"), [], TrainConfig(), room)
        q.submit(validating, [], TrainConfig())  # validated: queued in the place it holds
        assert q.cancel(queued.id) is not None
        until(lambda: (q.get(queued.id) or queued).status in TERMINAL, 20)
        late = q.submit(_job("carol"), [], TrainConfig(), room)
        assert (q.get(late.id) or late).status in (JobStatus.QUEUED, JobStatus.RUNNING)
        with pytest.raises(QueueFull):
            q.add(_job("dave"), room)
