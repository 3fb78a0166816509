"""At-least-once delivery on a real Redis: a claimed job whose worker went silent is run by another worker,
a job started too often fails with the reason, and nothing the job held outlives it."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from skillpool.adapters_store.store import SkillRecord
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.jobs.job import Job, new_job_id
from skillpool.trainer.jobs.redis_queue import _CLAIM, RedisJobQueue
from skillpool.trainer.records import TERMINAL, JobStatus
from tests.conftest import until


def _job() -> Job:
    return Job(id=new_job_id(), skill="s", method="isolated", config={})


def _record(job: Job) -> SkillRecord:
    return SkillRecord(name=job.skill, version=1, path=Path("/nonexistent"), meta={"training_job": job.id})


def _recording(runs: list[str]) -> Any:
    """A runner that notes each job it runs and returns a record for it."""

    def runner(j: Job, *_: Any) -> SkillRecord:
        runs.append(j.id)
        return _record(j)

    return runner


def _ended(q: RedisJobQueue, job: Job, timeout: float = 20) -> Job:
    """The job's record once it reaches a terminal state."""
    until(lambda: (q.get(job.id) or job).status in TERMINAL, timeout=timeout)
    done = q.get(job.id)
    assert done is not None
    return done


def _claim_and_die(r: redis.Redis, q: RedisJobQueue, ttl_ms: int) -> str:
    """What a worker does before it is SIGKILLed: claim the oldest job under a lease it never renews. Returns
    once that lease has expired, so the next worker's first sweep finds the job lost."""
    job_id = r.register_script(_CLAIM)(
        keys=[q.keys.queue, q.keys.processing], args=[q.keys.lease(""), "dead-worker", ttl_ms]
    )
    assert job_id is not None
    until(lambda: not r.exists(q.keys.lease(str(job_id))), timeout=10)
    return str(job_id)


def _renewals(r: redis.Redis, lease: str) -> Iterator[int]:
    """How often the lease was renewed so far, read at each `next`: its TTL rose since the read before."""
    count, last = 0, r.pttl(lease)
    while True:
        ttl = r.pttl(lease)
        count += ttl > last
        last = ttl
        yield count


def test_a_job_whose_worker_went_silent_is_run_by_another(redis_url: str) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    enqueuer = RedisJobQueue(redis_url, None, prefix=prefix)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    job = enqueuer.submit(enqueuer.add(_job()), [], TrainConfig())
    assert _claim_and_die(r, enqueuer, ttl_ms=300) == job.id
    assert enqueuer.depth() == 1  # claimed jobs count: the depth cannot lose them

    runs: list[str] = []
    # the dead worker's lease is short; the live one's is long enough to survive a loaded machine (it sweeps
    # every lease_s / 3)
    worker = RedisJobQueue(redis_url, _recording(runs), prefix=prefix, lease_s=3.0)
    try:
        done = _ended(enqueuer, job)
        assert done.status == JobStatus.SUCCEEDED, done
        assert runs == [job.id] and done.tries == 1
        # everything the job held ended with it: data, lease, its place in the lists
        assert enqueuer.depth() == 0
        assert not r.exists(enqueuer.keys.data(job.id), enqueuer.keys.lease(job.id))
    finally:
        worker.close()
        enqueuer.close()


def test_a_job_started_max_tries_times_fails_with_the_reason(redis_url: str) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    enqueuer = RedisJobQueue(redis_url, None, prefix=prefix)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    job = enqueuer.submit(enqueuer.add(_job()), [], TrainConfig())
    job.tries = 2  # two earlier workers started it and died
    enqueuer.update(job)
    _claim_and_die(r, enqueuer, ttl_ms=200)
    runs: list[str] = []
    worker = RedisJobQueue(redis_url, _recording(runs), prefix=prefix, lease_s=3.0, max_tries=2)
    try:
        done = _ended(enqueuer, job)
        assert done.status == JobStatus.FAILED and done.error_code == "max_tries_exceeded"
        assert "started 2 times" in (done.error or "") and runs == []
        assert enqueuer.depth() == 0 and not r.exists(enqueuer.keys.data(job.id))
    finally:
        worker.close()
        enqueuer.close()


def test_a_worker_keeps_its_lease_while_it_trains(redis_url: str) -> None:
    """A job longer than the lease is not taken from a live worker: its heartbeat renews the lease."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    release = threading.Event()
    runs: list[str] = []

    def slow(j: Job, *_: Any) -> SkillRecord:
        runs.append(j.id)
        release.wait(30)
        return _record(j)

    # 3 s as elsewhere here: shorter leases expired on busy machines (tries == 2) after the runner returned, most
    # likely during run_job's heap release (gc.collect holds the GIL); the wait below counts renewals, not seconds
    a = RedisJobQueue(redis_url, slow, prefix=prefix, lease_s=3.0)
    b = RedisJobQueue(redis_url, slow, prefix=prefix, lease_s=3.0)
    try:
        job = a.submit(a.add(_job()), [], TrainConfig())
        until(lambda: len(runs) == 1, timeout=10)
        lease = a.keys.lease(job.id)
        holder = a.r.get(lease)
        renewals = _renewals(a.r, lease)
        # renewed every third of the lease from a claim before the first: four renewals outlast the first lease
        until(lambda: next(renewals) >= 4, timeout=30)
        assert a.sweep() == [] and b.sweep() == []  # nothing lost: both workers' sweeps leave the job alone
        assert runs == [job.id] and a.r.get(lease) == holder
        release.set()
        done = _ended(a, job, timeout=10)
        assert done.status == JobStatus.SUCCEEDED and done.tries == 1
    finally:
        release.set()
        a.close()
        b.close()


def test_cancelling_a_job_whose_worker_died_ends_it(redis_url: str) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    q = RedisJobQueue(redis_url, None, prefix=prefix)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    job = q.submit(q.add(_job()), [], TrainConfig())
    _claim_and_die(r, q, ttl_ms=200)
    job.status = JobStatus.RUNNING
    q.update(job)
    assert q.cancel(job.id).status == JobStatus.RUNNING  # type: ignore[union-attr]  # its worker should see it
    worker = RedisJobQueue(redis_url, lambda *_: (_ for _ in ()).throw(AssertionError("ran")), prefix=prefix)
    try:
        assert _ended(q, job).status == JobStatus.CANCELLED
        assert q.depth() == 0 and not r.exists(q.keys.cancel(job.id), q.keys.data(job.id))
    finally:
        worker.close()
        q.close()


def test_a_job_queued_before_a_config_field_existed_trains_as_it_was_queued(redis_url: str) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    enqueuer = RedisJobQueue(redis_url, None, prefix=prefix)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    job = enqueuer.submit(enqueuer.add(_job()), [], TrainConfig())
    payload = json.loads(r.get(enqueuer.keys.data(job.id)) or "{}")
    del payload["config"]["prompt_variant_copies"]  # as a version before the field wrote it
    r.set(enqueuer.keys.data(job.id), json.dumps(payload))
    copies: list[int] = []

    def runner(j: Job, _examples: Any, cfg: TrainConfig, *_: Any) -> SkillRecord:
        copies.append(cfg.prompt_variant_copies)
        return _record(j)

    worker = RedisJobQueue(redis_url, runner, prefix=prefix, lease_s=3.0)
    try:
        assert _ended(enqueuer, job).status == JobStatus.SUCCEEDED
        assert copies == [1] and TrainConfig().prompt_variant_copies == 2  # the field's value then, not today's default
    finally:
        worker.close()
        enqueuer.close()
