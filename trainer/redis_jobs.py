"""The Redis-backed job queue: servers enqueue, trainer workers on any machine pull, events fan out.

Keys and the events channel live under a prefix (default "skillpool"); trainer/keys.py names them all.
Workers and servers share the skill store (a volume or object storage mounted at the same data dir).
When a worker stores a skill it publishes {"type": "skill_registered", "name", "version"}; every
server loads that version from the store and starts routing to it. Retiring a skill or rolling it back
publishes {"type": "skill_retired", "name"} or {"type": "skill_activated", "name", "version"} the same way.
Pub/sub drops what is published while a subscriber is disconnected, so every `resync_s` the listener also
hands on_event {"type": "resync"}: the server then serves exactly what the shared store says.
"""

from __future__ import annotations

import builtins
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from skillpool.adapters_store.store import SkillRecord

from .config import TrainConfig
from .jobs import Job, Runner, run_job
from .keys import DEFAULT_PREFIX, RedisKeys
from .records import TERMINAL, Example, JobStatus

log = logging.getLogger(__name__)


class RedisJobQueue:
    def __init__(
        self,
        url: str,
        runner: Runner | None,
        on_success: Callable[[SkillRecord], None] | None = None,
        on_finish: Callable[[Job], None] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        prefix: str = DEFAULT_PREFIX,
        resync_s: float = 60.0,
    ) -> None:
        """`runner` None: enqueue only (no worker here). `on_event`: called for every published event."""
        self.r = redis.Redis.from_url(url, decode_responses=True)
        try:
            self.r.ping()
        except redis.RedisError as e:
            raise ConnectionError(f"cannot reach Redis at {url}: {e}") from e
        self.keys = RedisKeys(prefix)
        self.runner, self.on_success, self.on_finish, self.on_event = runner, on_success, on_finish, on_event
        self.resync_s = resync_s
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        if runner is not None:
            self._threads.append(threading.Thread(target=self._work, name="skillpool-trainer", daemon=True))
        if on_event is not None:
            self._pubsub = self.r.pubsub(ignore_subscribe_messages=True)
            self._pubsub.subscribe(self.keys.events)
            self._threads.append(threading.Thread(target=self._listen, name="skillpool-events", daemon=True))
        for t in self._threads:
            t.start()

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
        return int(self.r.scard(self.keys.active))

    # --- API ----------------------------------------------------------------------------------
    def add(self, job: Job) -> Job:
        """Record a job that is not queued yet (its files are being validated)."""
        with self.r.pipeline() as pipe:
            pipe.set(self.keys.job(job.id), json.dumps(job.to_dict()))
            pipe.zadd(self.keys.jobs, {job.id: job.created_at})
            pipe.execute()
        return job

    def update(self, job: Job) -> None:
        self._save(job)

    def submit(self, job: Job, examples: builtins.list[Example], cfg: TrainConfig) -> Job:
        job.status = JobStatus.QUEUED
        job.log("Files validated, moving job to queued state")
        with self.r.pipeline() as pipe:  # MULTI/EXEC: a job is queued whole or not at all
            pipe.set(self.keys.job(job.id), json.dumps(job.to_dict()))
            pipe.zadd(self.keys.jobs, {job.id: job.created_at})
            pipe.set(self.keys.data(job.id), json.dumps({"examples": examples, "config": cfg.to_dict()}))
            pipe.rpush(self.keys.queue, job.id)
            pipe.sadd(self.keys.active, job.id)
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
            self.r.delete(self.keys.data(job_id))
            self._finish(job, JobStatus.CANCELLED, None)
        return self.get(job_id)

    def publish(self, event: dict[str, Any]) -> None:
        self.r.publish(self.keys.events, json.dumps(event))

    def close(self) -> None:
        self._closed.set()
        if self.on_event is not None:
            self._pubsub.close()

    # --- worker -------------------------------------------------------------------------------
    def _finish(self, job: Job, status: JobStatus, error: str | None, code: str | None = None) -> None:
        job.finish(status, error, code)
        with self.r.pipeline() as pipe:
            pipe.set(self.keys.job(job.id), json.dumps(job.to_dict()))
            pipe.srem(self.keys.active, job.id)
            pipe.execute()
        if self.on_finish is not None:
            self.on_finish(job)

    def _succeeded(self, record: SkillRecord) -> None:
        if self.on_success is not None:
            self.on_success(record)
        self.publish({"type": "skill_registered", "name": record.name, "version": record.version})

    def _work(self) -> None:
        assert self.runner is not None
        while not self._closed.is_set():
            try:
                item = self.r.blpop([self.keys.queue], timeout=1)
            except redis.RedisError as e:
                log.warning("job queue unreachable (%s); retrying", e)
                time.sleep(2)
                continue
            if item is None:
                continue
            try:
                self._run(str(item[1]))
            except redis.RedisError as e:  # never let the trainer thread die silently on a Redis error
                log.warning("job queue unreachable while running job %s (%s); going on", item[1], e)
                time.sleep(2)

    def _run(self, job_id: str) -> None:
        """Take a popped job: its data, the running state, training (the data key goes once: at most once)."""
        assert self.runner is not None
        job, raw = self.get(job_id), self.r.getdel(self.keys.data(job_id))
        if job is None or raw is None or job.status in TERMINAL:
            return
        data = json.loads(raw)
        job.status, job.started_at = JobStatus.RUNNING, time.time()
        job.log("Fine-tuning job started")
        self._save(job)
        cancel_key = self.keys.cancel(job_id)

        def cancelled(key: str = cancel_key) -> bool:
            return bool(self.r.exists(key))

        run_job(
            job,
            data["examples"],
            TrainConfig.from_dict(data["config"]),
            self.runner,
            self._save,
            self._finish,
            self._succeeded,
            cancelled,
        )

    def _listen(self) -> None:
        assert self.on_event is not None
        next_resync = time.monotonic() + self.resync_s
        while not self._closed.is_set():
            if time.monotonic() >= next_resync:
                next_resync = time.monotonic() + self.resync_s
                try:
                    self.on_event({"type": "resync"})
                except Exception:
                    log.exception("resync with the skill store failed")
            try:
                msg = self._pubsub.get_message(timeout=1.0)
            except (redis.RedisError, ValueError, AttributeError):
                if self._closed.is_set():
                    return
                time.sleep(1)
                continue
            if msg and msg.get("type") == "message":
                try:
                    self.on_event(json.loads(msg["data"]))
                except Exception:
                    log.exception("event handler failed for %s", msg.get("data"))
