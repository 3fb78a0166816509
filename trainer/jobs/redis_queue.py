"""The Redis-backed job queue: servers enqueue, trainer workers on any machine pull.

Keys live under a prefix (default "skillpool"); trainer/keys.py names them all. Workers and servers share
the skill store (a volume or object storage mounted at the same data dir).

Jobs are delivered at least once (a reliable list, as in Redis' RPOPLPUSH pattern): a worker moves a job id
from `queue` to `processing` and sets a lease in the same script, then renews the lease while it trains. A
job whose lease expires (its worker was SIGKILLed, OOM-killed, cut off) goes back to the queue the next time
any worker sweeps; each start counts as a try and a job that was started `max_tries` times fails with that
reason. The job's data stays until the job ends, the queue depth is the two lists' lengths (nothing to leak),
and a retried job first looks for a skill version its earlier try already wrote, so a version is written once.
The jobs that have not ended are also in the `pending` hash with their owners: a job is admitted against the
limits in the same script that records and queues it (_ADMIT), and leaves the hash in the step that ends it.

A worker that is closed (`close`: its process is stopping) stops the job it trains at its next check and, while it
still holds the lease, puts it back at the front of the queue at once; the start still counts as a try.

A job that ends stored hands its skill to `on_success` (the worker's start-up announces it on the skill-event
bus, trainer.bus).

A job reserves its skill's name across every server (trainer.jobs.reservations): `skill:<name>` holds its id, set
only if no live job holds it (a holder whose record has ended is replaced), deleted when the job ends. Until the
job's record exists the key has a TTL, so a server that dies while creating a job frees the name by itself.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import redis

from skillpool.adapters_store.store import SkillRecord

from ..config import TrainConfig, as_recorded_now
from ..keys import DEFAULT_PREFIX, RedisKeys
from ..records import TERMINAL, Example, JobStatus
from .failures import describe
from .job import Job, QueueFull, Room, Runner, run_job
from .reservations import CREATION_GRACE_S, RELEASE_SCRIPT, RESERVE_SCRIPT

log = logging.getLogger(__name__)

# KEYS: queue, processing; ARGV: lease key prefix, worker id, lease ms. Move the oldest job to processing and
# lease it in one step, so no sweep can see it in processing without a lease.
_CLAIM = """
local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
if id then redis.call('SET', ARGV[1] .. id, ARGV[2], 'PX', ARGV[3]) end
return id
"""
# KEYS: queue, processing; ARGV: lease key prefix. Requeue (at the front) every claimed job without a lease.
_SWEEP = """
local lost = {}
for _, id in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  if redis.call('EXISTS', ARGV[1] .. id) == 0 then
    redis.call('LREM', KEYS[2], 1, id)
    redis.call('LPUSH', KEYS[1], id)
    table.insert(lost, id)
  end
end
return lost
"""
# KEYS: pending, job, jobs, skill, data, queue; ARGV: job id, owner, limit, per-key limit (0: none), job record key
# prefix, record, created at, data ("": record the job, do not queue it). Admit the job if it fits beside the jobs
# that have not ended (those whose record has ended or is gone leave the hash here too), then record it, and queue
# it with its data, all in one step: two servers' uploads cannot both take the last place.
_ADMIT = """
local n, mine = 0, 0
local pending = redis.call('HGETALL', KEYS[1])
for i = 1, #pending, 2 do
  local id, owner = pending[i], pending[i + 1]
  local raw = redis.call('GET', ARGV[5] .. id)
  local status = raw and cjson.decode(raw)['status']
  if not status or status == 'succeeded' or status == 'failed' or status == 'cancelled' then
    redis.call('HDEL', KEYS[1], id)
  elseif id ~= ARGV[1] then
    n = n + 1
    if owner == ARGV[2] then mine = mine + 1 end
  end
end
if n >= tonumber(ARGV[3]) then return {0, n} end
if tonumber(ARGV[4]) > 0 and mine >= tonumber(ARGV[4]) then return {-1, mine} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[6])
redis.call('ZADD', KEYS[3], ARGV[7], ARGV[1])
redis.call('PERSIST', KEYS[4])
if ARGV[8] ~= '' then
  redis.call('SET', KEYS[5], ARGV[8])
  redis.call('RPUSH', KEYS[6], ARGV[1])
end
return {1, n}
"""
# KEYS: lease; ARGV: worker id, lease ms. Renew only a lease this worker still holds.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class RedisJobQueue:
    def __init__(
        self,
        url: str,
        runner: Runner | None,
        on_success: Callable[[SkillRecord], None] | None = None,
        on_finish: Callable[[Job], None] | None = None,
        prefix: str = DEFAULT_PREFIX,
        lease_s: float = 30.0,
        max_tries: int = 3,
    ) -> None:
        """`runner` None: enqueue only (no worker here). `on_success`: a job stored this skill version.
        `lease_s`: how long a silent worker keeps its job (it renews every third of that while alive)."""
        if lease_s <= 0 or max_tries < 1:
            raise ValueError("lease_s must be > 0 and max_tries >= 1")
        # timeouts: a Redis that hangs (not refuses) must not hold a handler or the trainer thread for long
        self.r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5)
        try:
            self.r.ping()
        except redis.RedisError as e:
            raise ConnectionError(f"cannot reach Redis at {url}: {e}") from e
        self.keys = RedisKeys(prefix)
        self.runner, self.on_success, self.on_finish = runner, on_success, on_finish
        self.lease_s, self.max_tries = lease_s, max_tries
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        scripts = (_CLAIM, _SWEEP, _RENEW, RESERVE_SCRIPT, RELEASE_SCRIPT, _ADMIT)
        self._claim, self._sweep, self._renew, self._reserve, self._release, self._admit = map(
            self.r.register_script, scripts
        )
        self._closed = threading.Event()
        self._worker: threading.Thread | None = None
        if runner is not None:
            self._worker = threading.Thread(target=self._work, name="skillpool-trainer", daemon=True)
            self._worker.start()

    # --- records ------------------------------------------------------------------------------
    def _save(self, job: Job) -> None:
        self.r.set(self.keys.job(job.id), json.dumps(job.to_dict()))

    def get(self, job_id: str) -> Job | None:
        raw = self.r.get(self.keys.job(job_id))
        return Job.from_dict(json.loads(raw)) if raw else None

    def list(self) -> list[Job]:
        ids: list[str] = self.r.zrevrange(self.keys.jobs, 0, -1)  # type: ignore[assignment]  # decode_responses
        raws = self.r.mget([self.keys.job(i) for i in ids]) if ids else []
        return [Job.from_dict(json.loads(x)) for x in raws if x]

    def depth(self) -> int:
        """Queued plus claimed jobs: both lists only ever hold jobs that have not ended."""
        return sum(self.counts())

    def counts(self) -> tuple[int, int]:
        """(queued, claimed) jobs of the whole shared queue, read in one round trip."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.llen(self.keys.queue)
            pipe.llen(self.keys.processing)
            queued, claimed = pipe.execute()
        return int(queued), int(claimed)

    # --- API ----------------------------------------------------------------------------------
    def add(self, job: Job, room: Room | None = None) -> Job:
        """Record a job that is not queued yet (its files are being validated)."""
        if room is not None:
            self._admitted(job, room, None)
            return job
        with self.r.pipeline() as pipe:
            pipe.set(self.keys.job(job.id), json.dumps(job.to_dict()))
            pipe.zadd(self.keys.jobs, {job.id: job.created_at})
            pipe.hset(self.keys.pending, job.id, job.owner or "")
            pipe.persist(self.keys.skill(job.skill))  # recorded: the name is held until the job ends
            pipe.execute()
        return job

    def _admitted(self, job: Job, room: Room, data: str | None) -> None:
        """Record `job` (and with `data`, queue it) if it fits in `room`, in one script; QueueFull otherwise."""
        keys = self.keys
        record = json.dumps(job.to_dict())
        args: builtins.list[str | int | float] = [job.id, job.owner or "", room.limit, room.per_key or 0]
        args += [keys.job(""), record, job.created_at, data or ""]
        admitted, count = self._admit(
            keys=[keys.pending, keys.job(job.id), keys.jobs, keys.skill(job.skill), keys.data(job.id), keys.queue],
            args=args,
        )
        if int(admitted) != 1:
            raise QueueFull(int(count), room, per_key=int(admitted) == -1)

    def update(self, job: Job) -> None:
        if job.status not in TERMINAL:
            self._save(job)
            return
        with self.r.pipeline() as pipe:
            pipe.set(self.keys.job(job.id), json.dumps(job.to_dict()))
            pipe.hdel(self.keys.pending, job.id)
            self._release(keys=[self.keys.skill(job.skill)], args=[job.id], client=pipe)
            pipe.execute()

    def reserve(self, job: Job) -> str | None:
        grace = int(CREATION_GRACE_S * 1000)
        holder = self._reserve(keys=[self.keys.skill(job.skill)], args=[job.id, self.keys.job(""), grace])
        return str(holder) if holder else None

    def release(self, job: Job) -> None:
        self._release(keys=[self.keys.skill(job.skill)], args=[job.id])

    def trainer_alive(self) -> bool | None:
        """Whether this process' worker thread runs; None where it runs none, or once closed (on purpose)."""
        if self._worker is None or self._closed.is_set():
            return None
        return self._worker.is_alive()

    def submit(self, job: Job, examples: builtins.list[Example], cfg: TrainConfig, room: Room | None = None) -> Job:
        before, events = job.status, len(job.events)
        job.status = JobStatus.QUEUED
        job.log("Files validated, moving job to queued state")
        data = json.dumps({"examples": examples, "config": cfg.to_dict()})
        if room is not None:
            try:
                self._admitted(job, room, data)
            except QueueFull:
                job.status = before
                del job.events[events:]
                raise
            return job
        with self.r.pipeline() as pipe:  # MULTI/EXEC: a job is queued whole or not at all
            pipe.set(self.keys.job(job.id), json.dumps(job.to_dict()))
            pipe.zadd(self.keys.jobs, {job.id: job.created_at})
            pipe.set(self.keys.data(job.id), data)
            pipe.rpush(self.keys.queue, job.id)
            pipe.hset(self.keys.pending, job.id, job.owner or "")
            pipe.persist(self.keys.skill(job.skill))
            pipe.execute()
        return job

    def cancel(self, job_id: str) -> Job | None:
        job = self.get(job_id)
        if job is None or job.status in TERMINAL:
            return job
        self.r.set(self.keys.cancel(job_id), 1)
        if job.status == JobStatus.VALIDATING:  # not queued yet: its creator sees the cancel before queueing
            self._finish(job, JobStatus.CANCELLED, None)
        elif self.r.lrem(self.keys.queue, 0, job_id):  # still queued: no worker has it
            self._finish(job, JobStatus.CANCELLED, None)
        # claimed: its worker sees the cancel key (or, if that worker is gone, the next one does)
        return self.get(job_id)

    def close(self, timeout_s: float = 0.0) -> None:
        """Claim nothing more; the running job stops at its next check and goes back to the queue. Waits up to
        `timeout_s` for it (past that, its lease expiring requeues it). Idempotent."""
        self._closed.set()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout_s)

    # --- worker -------------------------------------------------------------------------------
    def _finish(self, job: Job, status: JobStatus, error: str | None, code: str | None = None) -> None:
        """The terminal state and the end of everything the job held, in one transaction."""
        job.finish(status, error, code)
        with self.r.pipeline() as pipe:
            pipe.set(self.keys.job(job.id), json.dumps(job.to_dict()))
            pipe.lrem(self.keys.processing, 0, job.id)
            pipe.hdel(self.keys.pending, job.id)
            pipe.delete(self.keys.data(job.id), self.keys.lease(job.id), self.keys.cancel(job.id))
            self._release(keys=[self.keys.skill(job.skill)], args=[job.id], client=pipe)
            pipe.execute()
        if self.on_finish is not None:
            self.on_finish(job)

    def _requeue(self, job: Job) -> None:
        """Back at the front of the queue, its lease given up, in one transaction."""
        job.status, job.started_at = JobStatus.QUEUED, None
        job.log("The worker stopped before this job finished; it is back in the queue")
        with self.r.pipeline() as pipe:
            pipe.set(self.keys.job(job.id), json.dumps(job.to_dict()))
            pipe.lrem(self.keys.processing, 0, job.id)
            pipe.lpush(self.keys.queue, job.id)
            pipe.delete(self.keys.lease(job.id))
            pipe.execute()
        log.info("job %s: back in the queue (this worker is stopping)", job.id)

    def _succeeded(self, record: SkillRecord) -> None:
        if self.on_success is not None:
            self.on_success(record)

    def sweep(self) -> builtins.list[str]:
        """Requeue claimed jobs whose lease expired (their worker is gone); returns their ids."""
        lost = [str(x) for x in self._sweep(keys=[self.keys.queue, self.keys.processing], args=[self._lease_prefix])]
        for job_id in lost:
            log.warning("job %s lost its worker (lease expired); requeued", job_id)
        return lost

    @property
    def _lease_prefix(self) -> str:
        return self.keys.lease("")

    def _work(self) -> None:
        assert self.runner is not None
        next_sweep = 0.0
        while not self._closed.is_set():
            try:
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self.lease_s / 3
                    self.sweep()
                job_id = self._claim(
                    keys=[self.keys.queue, self.keys.processing],
                    args=[self._lease_prefix, self.worker_id, int(self.lease_s * 1000)],
                )
            except redis.RedisError as e:
                log.warning("job queue unreachable (%s); retrying", e)
                self._closed.wait(2)
                continue
            if job_id is None:
                self._closed.wait(0.5)
                continue
            try:
                self._run(str(job_id))
            except redis.RedisError as e:  # never let the trainer thread die silently on a Redis error
                log.warning("job queue unreachable while running job %s (%s); going on", job_id, e)
                self._closed.wait(2)
            except Exception as e:  # nor on anything else: the job ends failed, the worker takes the next one
                log.exception("job %s: the worker caught an error", job_id)
                self._fail(str(job_id), e)

    def _fail(self, job_id: str, e: Exception) -> None:
        try:
            job = self.get(job_id)
            if job is not None and job.status not in TERMINAL:
                code, message = describe(e)
                self._finish(job, JobStatus.FAILED, message, code)
        except Exception:  # Redis gone too: the lease expires and a sweep retries the job
            log.exception("job %s: could not record its failure", job_id)

    def _run(self, job_id: str) -> None:
        """Run a claimed job under its lease: renewed while training, checked before the job's end is written."""
        assert self.runner is not None
        job, raw = self.get(job_id), self.r.get(self.keys.data(job_id))
        if job is None or job.status in TERMINAL:  # ended elsewhere (a cancel raced the claim): just let go
            with self.r.pipeline() as pipe:
                pipe.lrem(self.keys.processing, 0, job_id)
                pipe.delete(self.keys.lease(job_id))
                pipe.execute()
            return
        if raw is None:
            self._finish(job, JobStatus.FAILED, "the job's data is missing from Redis", "job_data_lost")
            return
        if self.r.exists(self.keys.cancel(job_id)):
            self._finish(job, JobStatus.CANCELLED, None)
            return
        job.tries += 1
        if job.tries > self.max_tries:
            self._finish(
                job,
                JobStatus.FAILED,
                f"the job was started {self.max_tries} times and its worker stopped each time (killed or cut off)",
                "max_tries_exceeded",
            )
            return
        data = json.loads(raw)
        retry = f" (try {job.tries} of {self.max_tries})" if job.tries > 1 else ""
        job.status, job.started_at = JobStatus.RUNNING, time.time()
        job.log(f"Fine-tuning job started{retry}")
        self._save(job)
        lease = _Lease(self, job_id)
        cancel_key = self.keys.cancel(job_id)

        def stop() -> bool:  # a lost lease stops training too: another worker has the job by now
            return self._closed.is_set() or lease.lost.is_set() or bool(self.r.exists(cancel_key))

        def save(j: Job) -> None:
            if not lease.lost.is_set():
                self._save(j)

        def finish(j: Job, status: JobStatus, error: str | None, code: str | None) -> None:
            if not lease.held():  # fenced: a worker that lost its lease writes no ending over the new try's work
                log.warning("job %s: lease lost; leaving its end to the worker that has it now", job_id)
            elif status == JobStatus.CANCELLED and self._closed.is_set() and not self.r.exists(cancel_key):
                self._requeue(j)  # stopped because this process stops, not cancelled: another worker takes it
            else:
                self._finish(j, status, error, code)

        with lease:
            run_job(
                job,
                data["examples"],
                TrainConfig.from_dict(as_recorded_now(data["config"])),  # queued by an earlier version too
                self.runner,
                save,
                finish,
                self._succeeded,
                stop,
            )


class _Lease:
    """Renews a claimed job's lease every third of its TTL while the job runs; `lost` is set once it cannot."""

    def __init__(self, q: RedisJobQueue, job_id: str) -> None:
        self.q, self.key = q, q.keys.lease(job_id)
        self.lost, self._done = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"skillpool-lease-{job_id}", daemon=True)

    def __enter__(self) -> _Lease:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def held(self) -> bool:
        try:
            return not self.lost.is_set() and self.q.r.get(self.key) == self.q.worker_id
        except redis.RedisError:
            return False

    def _beat(self) -> None:
        ms = int(self.q.lease_s * 1000)
        while not self._done.wait(self.q.lease_s / 3):
            try:
                if not self.q._renew(keys=[self.key], args=[self.q.worker_id, ms]):
                    self.lost.set()
                    return
            except redis.RedisError as e:  # a short outage is survivable: the lease outlives a few beats
                log.warning("cannot renew lease %s (%s)", self.key, e)
