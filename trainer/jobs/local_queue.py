"""The in-process job queue: one worker thread in this process trains the jobs one by one.

Job records are kept as JSON under <data>/jobs so that they survive a restart; a job that was queued or running
when the server stopped is marked failed (its data is gone with the process' queue) and can be re-uploaded: on a
clean stop (`close`) at once, with the code `server_stopped`; after a kill, at the next start (`server_restarted`).
A record that cannot be written (disk full) stops nothing: an API call that creates a job fails whole
(StorageError, nothing recorded or queued), while the worker keeps the record in memory, goes on, and writes it
as soon as the disk lets it (the next save, or a retry every RETRY_SAVE_S while idle).
"""

from __future__ import annotations

import builtins
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from skillpool.adapters_store.diskio import atomic_write, sweep
from skillpool.adapters_store.store import SkillRecord

from ..config import TrainConfig
from ..records import PENDING, TERMINAL, Example, JobStatus
from .failures import describe
from .job import SERVER_STOPPED, Job, Room, Runner, admits, run_job
from .reservations import NameReservations

log = logging.getLogger(__name__)

RETRY_SAVE_S = 5.0  # how often an idle worker retries writing records a full disk refused


class LocalJobQueue:
    """FIFO queue with one worker thread in this process. `runner` trains; `on_success` registers."""

    def __init__(
        self,
        jobs_dir: Path,
        runner: Runner,
        on_success: Callable[[SkillRecord], None],
        on_finish: Callable[[Job], None] | None = None,
    ) -> None:
        self.dir = jobs_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.runner, self.on_success, self.on_finish = runner, on_success, on_finish
        self._jobs: dict[str, Job] = {}
        self._cancel: dict[str, threading.Event] = {}
        self._queue: queue.Queue[tuple[Job, list[Example], TrainConfig] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._disk = threading.Lock()  # one record write at a time, and the set of those not written yet
        self._unsaved: set[str] = set()
        self._stopping = threading.Event()  # close(): the running job stops, nothing more runs
        self._names = NameReservations(lambda job_id: j.status if (j := self._jobs.get(job_id)) else None)
        sweep(self.dir)  # a record write a kill or a full disk cut short
        self._load()
        self._thread = threading.Thread(target=self._work, name="skillpool-trainer", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        for p in sorted(self.dir.glob("job-*.json")):
            try:
                job = Job.from_dict(json.loads(p.read_text()))
            except (ValueError, TypeError) as e:
                log.warning("ignoring unreadable job record %s: %s", p, e)
                continue
            self._jobs[job.id] = job  # in memory first: a save that fails is retried from here
            if job.status not in TERMINAL:
                job.finish(JobStatus.FAILED, "the server stopped before this job finished", "server_restarted")
                self._save(job)

    def _write(self, job: Job) -> None:
        """Write the record now, then any an earlier save could not; StorageError if this one cannot be."""
        with self._disk:
            self._put(job)
            self._unsaved.discard(job.id)
            self._flush()

    def _put(self, job: Job) -> None:
        atomic_write(self.dir / f"{job.id}.json", json.dumps(job.to_dict()).encode(), fsync=False)

    def _flush(self) -> None:
        for job_id in list(self._unsaved):
            if (job := self._jobs.get(job_id)) is not None:
                try:
                    self._put(job)
                except OSError:
                    return  # still full: the next save or the idle retry tries again
            self._unsaved.discard(job_id)

    def _save(self, job: Job) -> None:
        """Write the record, or keep it in memory to write later: a full disk never stops the worker."""
        try:
            self._write(job)
        except OSError as e:
            with self._disk:
                if job.id not in self._unsaved:
                    log.error("job %s: record not written (%s); kept in memory and retried", job.id, e)
                self._unsaved.add(job.id)

    def unsaved(self) -> set[str]:  # jobs whose latest state is not on disk yet
        with self._disk:
            return set(self._unsaved)

    # --- API ----------------------------------------------------------------------------------
    def add(self, job: Job, room: Room | None = None) -> Job:
        """Record a job that is not queued yet (its files are being validated). StorageError: nothing recorded."""
        with self._lock:
            self._admit(job, room)
            self._write(job)
            self._jobs[job.id] = job
        return job

    def update(self, job: Job) -> None:
        with self._lock:
            self._jobs[job.id] = job
            self._save(job)
        if job.status in TERMINAL:
            self._names.release(job.skill, job.id)

    def reserve(self, job: Job) -> str | None:
        return self._names.reserve(job.skill, job.id)

    def release(self, job: Job) -> None:
        self._names.release(job.skill, job.id)

    def trainer_alive(self) -> bool | None:
        """Whether the trainer thread runs; None once closed (stopped on purpose: not a dead trainer)."""
        return None if self._stopping.is_set() else self._thread.is_alive()

    def submit(self, job: Job, examples: list[Example], cfg: TrainConfig, room: Room | None = None) -> Job:
        """Queue a job. StorageError (disk full): nothing queued, the job as it was (not counted as pending). Once
        the queue is closing the job ends failed (server_stopped) instead: nothing would train it."""
        if self._stopping.is_set():
            self._finish(job, JobStatus.FAILED, *SERVER_STOPPED)
            return job
        with self._lock:
            self._admit(job, room)
            before, events = job.status, len(job.events)
            job.status = JobStatus.QUEUED
            job.log("Files validated, moving job to queued state")
            try:
                self._write(job)
            except OSError:
                job.status = before
                del job.events[events:]
                raise
            self._jobs[job.id] = job
            self._cancel[job.id] = threading.Event()
        self._queue.put((job, examples, cfg))
        return job

    def _admit(self, job: Job, room: Room | None) -> None:
        """QueueFull unless `job` fits in `room` (under self._lock: the check and the record are one step)."""
        if room is not None:
            admits(
                room, [j.owner for j in self._jobs.values() if j.status not in TERMINAL and j.id != job.id], job.owner
            )

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def list(self) -> list[Job]:
        return sorted(self._jobs.values(), key=lambda j: j.created_at, reverse=True)

    def depth(self) -> int:
        return sum(1 for j in self._jobs.values() if j.status in PENDING)

    def counts(self) -> tuple[int, int]:
        statuses = [j.status for j in list(self._jobs.values())]
        return statuses.count(JobStatus.QUEUED), statuses.count(JobStatus.RUNNING)

    def cancel(self, job_id: str) -> Job | None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.status in TERMINAL:
                return job
            if job_id in self._cancel:
                self._cancel[job_id].set()
            if job.status in (JobStatus.QUEUED, JobStatus.VALIDATING):  # the worker skips it when it comes up
                self._finish(job, JobStatus.CANCELLED)
            return job

    def close(self, timeout_s: float = 0.0) -> None:
        """Stop training: queued jobs end failed (server_stopped) now, the running one at its next check; waits up
        to `timeout_s` for it, then records any job still running as failed the same way (the process is ending).
        Idempotent."""
        self._stopping.set()
        with self._lock:
            queued = [j for j in self._jobs.values() if j.status == JobStatus.QUEUED]
        for job in queued:
            self._finish(job, JobStatus.FAILED, *SERVER_STOPPED)
        self._queue.put(None)
        self._thread.join(timeout_s)
        with self._lock:
            running = [j for j in self._jobs.values() if j.status == JobStatus.RUNNING]
        for job in running:
            log.warning("job %s: still training %.0f s after the stop; recorded as failed", job.id, timeout_s)
            self._finish(job, JobStatus.FAILED, *SERVER_STOPPED)

    # --- worker -------------------------------------------------------------------------------
    def _finish(self, job: Job, status: JobStatus, error: str | None = None, code: str | None = None) -> None:
        job.finish(status, error, code)
        self._save(job)
        self._names.release(job.skill, job.id)
        if self.on_finish is not None:
            try:
                self.on_finish(job)
            except Exception:
                log.exception("on_finish failed for job %s", job.id)

    def _work(self) -> None:
        while True:
            try:  # idle: now and then, retry the records a full disk refused
                item = self._queue.get(timeout=RETRY_SAVE_S)
            except queue.Empty:
                if self._unsaved:
                    with self._disk:
                        self._flush()
                continue
            if item is None:
                return
            job = item[0]
            try:
                self._run(*item)
            except Exception as e:  # the job ends; the worker lives on for the next one
                log.exception("job %s: the worker caught an error", job.id)
                if job.status not in TERMINAL:
                    code, message = describe(e)
                    self._finish(job, JobStatus.FAILED, message, code)

    def _run(self, job: Job, examples: builtins.list[Example], cfg: TrainConfig) -> None:
        stop = self._cancel[job.id]
        with self._lock:  # the check and the start are one step: a cancel between them would be undone
            if stop.is_set() or job.status in TERMINAL:  # cancelled, or ended by close() while it waited
                return
            job.status, job.started_at = JobStatus.RUNNING, time.time()
            job.log("Fine-tuning job started")
            self._save(job)

        def finish(j: Job, status: JobStatus, error: str | None, code: str | None) -> None:
            if j.status in TERMINAL:  # close() gave up waiting and recorded its end already
                return
            if status == JobStatus.CANCELLED and not stop.is_set():  # stopped by close(), not by its owner
                status, (error, code) = JobStatus.FAILED, SERVER_STOPPED
            self._finish(j, status, error, code)

        def should_stop() -> bool:
            return stop.is_set() or self._stopping.is_set()

        run_job(job, examples, cfg, self.runner, self._save, finish, self.on_success, should_stop)
