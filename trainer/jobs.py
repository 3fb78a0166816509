"""Training jobs: records, states, and the in-process queue with its background worker.

States: validating → queued → running → succeeded | failed | cancelled. Job records are kept as
JSON under <data>/jobs so that they survive a restart; a job that was queued or running when the
server stopped is marked failed (its data is gone with the process' queue) and can be re-uploaded.
A record that cannot be written (disk full) stops nothing: an API call that creates a job fails whole
(StorageError, nothing recorded or queued), while the worker keeps the record in memory, goes on, and writes it
as soon as the disk lets it (the next save, or a retry every RETRY_SAVE_S while idle). Whatever a job raises,
the job ends failed and the worker thread lives on.
A job also keeps its events (OpenAI's fine-tuning job events: state changes, training metrics, the quality
gate's numbers), so they survive with the record and reach every server through the shared queue.
"""

from __future__ import annotations

import builtins
import json
import logging
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from skillpool.adapters_store.diskio import atomic_write, sweep
from skillpool.adapters_store.store import SkillRecord

from .config import TrainConfig
from .events import SkillEvent
from .failures import describe, redact_paths
from .heap import release_freed_memory
from .loop import Cancelled, Progress
from .quality import QualityGateFailed
from .records import PENDING, TERMINAL, Example, JobStatus
from .reservations import NameReservations

log = logging.getLogger(__name__)


@dataclass
class Job:
    id: str
    skill: str
    method: str
    config: dict[str, Any]
    status: JobStatus = JobStatus.QUEUED
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    progress: dict[str, Any] = field(default_factory=lambda: {"step": 0, "total": None, "loss": None})
    eval: dict[str, Any] | None = None
    error: str | None = None
    examples: int = 0
    skill_version: int | None = None
    force: bool = False  # register even if the quality gate fails
    error_code: str | None = None  # machine-readable reason (OpenAI's error.code), beside the message
    error_param: str | None = None  # the request field the failure is about (a bad file: training_file)
    fine_tuning: dict[str, Any] | None = None  # a job made by /v1/fine_tuning/jobs: its request and model id
    events: list[dict[str, Any]] = field(default_factory=list)  # oldest first
    tries: int = 0  # how many times a worker has started it (a Redis job whose worker died is retried)
    owner: str | None = None  # the name (never the secret) of the API key that created it; None: no keys

    def __post_init__(self) -> None:  # a record read back from JSON holds the plain string
        self.status = JobStatus(self.status)

    def to_dict(self) -> dict[str, Any]:
        return {"object": "skillpool.training_job", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Job:
        return cls(**{k: v for k, v in d.items() if k != "object"})

    def log(self, message: str, level: str = "info", kind: str = "message", data: dict[str, Any] | None = None) -> None:
        """Record an event; metrics events beyond MAX_METRIC_EVENTS drop the oldest (a long job keeps its tail)."""
        self.events.append(
            {
                "id": f"ftevent-{uuid.uuid4().hex[:20]}",
                "created_at": int(time.time()),
                "level": level,
                "message": message,
                "type": kind,
                "data": data,
            }
        )
        metrics = [i for i, e in enumerate(self.events) if e["type"] == "metrics"]
        if len(metrics) > MAX_METRIC_EVENTS:
            del self.events[metrics[0]]

    def finish(
        self, status: JobStatus, error: str | None = None, code: str | None = None, param: str | None = None
    ) -> None:
        """Move to a terminal state and say so in the events. `error` is shown to users: paths are cut."""
        error = redact_paths(error) if error else error
        self.status, self.error, self.finished_at = status, error, time.time()
        self.error_code, self.error_param = (code or "training_failed", param) if error else (None, None)
        if status == JobStatus.SUCCEEDED:
            self.log("The job has successfully completed")
        elif status == JobStatus.CANCELLED:
            self.log("Fine-tuning job cancelled")
        else:
            self.log(f"Fine-tuning job failed: {error}", level="error")


MAX_METRIC_EVENTS = 200
RETRY_SAVE_S = 5.0  # how often an idle worker retries writing records a full disk refused


def new_job_id() -> str:
    return "job-" + uuid.uuid4().hex[:20]


class JobQueue(Protocol):
    """What the API needs from a queue: LocalJobQueue (in-process) or RedisJobQueue (shared)."""

    def submit(self, job: Job, examples: list[Example], cfg: TrainConfig) -> Job: ...
    def add(self, job: Job) -> Job: ...
    def update(self, job: Job) -> None: ...
    def publish(self, event: SkillEvent) -> None: ...
    def get(self, job_id: str) -> Job | None: ...
    def list(self) -> list[Job]: ...
    def depth(self) -> int: ...
    def cancel(self, job_id: str) -> Job | None: ...
    def close(self) -> None: ...
    # job.skill for this job until it ends (trainer.reservations): None, or the id of the job that holds it
    def reserve(self, job: Job) -> str | None: ...
    def release(self, job: Job) -> None: ...  # a reservation whose job was never recorded (its creation failed)
    def trainer_alive(self) -> bool | None: ...  # this process' trainer thread runs; None: it runs none here


Runner = Callable[[Job, list[Example], TrainConfig, Callable[[Progress], None], Callable[[], bool]], SkillRecord]


class LocalJobQueue:
    """FIFO queue with one worker thread in this process. `runner` trains; `on_success` registers."""

    def __init__(
        self,
        jobs_dir: Path,
        runner: Runner,
        on_success: Callable[[SkillRecord], None],
        on_finish: Callable[[Job], None] | None = None,
        on_event: Callable[[SkillEvent], None] | None = None,
    ) -> None:
        self.dir = jobs_dir
        self.on_event = on_event  # skill events (retired, activated) go straight back to this server
        self.dir.mkdir(parents=True, exist_ok=True)
        self.runner, self.on_success, self.on_finish = runner, on_success, on_finish
        self._jobs: dict[str, Job] = {}
        self._cancel: dict[str, threading.Event] = {}
        self._queue: queue.Queue[tuple[Job, list[Example], TrainConfig] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._disk = threading.Lock()  # one record write at a time, and the set of those not written yet
        self._unsaved: set[str] = set()
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
    def add(self, job: Job) -> Job:
        """Record a job that is not queued yet (its files are being validated). StorageError: nothing recorded."""
        with self._lock:
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

    def trainer_alive(self) -> bool:
        return self._thread.is_alive()

    def publish(self, event: SkillEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def submit(self, job: Job, examples: list[Example], cfg: TrainConfig) -> Job:
        """Queue a job. StorageError (disk full): nothing queued, the job as it was (not counted as pending)."""
        with self._lock:
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

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def list(self) -> list[Job]:
        return sorted(self._jobs.values(), key=lambda j: j.created_at, reverse=True)

    def depth(self) -> int:
        return sum(1 for j in self._jobs.values() if j.status in PENDING)

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

    def close(self) -> None:
        self._queue.put(None)

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
        if stop.is_set():
            return
        with self._lock:
            job.status, job.started_at = JobStatus.RUNNING, time.time()
            job.log("Fine-tuning job started")
            self._save(job)
        run_job(job, examples, cfg, self.runner, self._save, self._finish, self.on_success, stop.is_set)


def run_job(
    job: Job,
    examples: list[Example],
    cfg: TrainConfig,
    runner: Runner,
    save: Callable[[Job], None],
    finish: Callable[[Job, JobStatus, str | None, str | None], None],
    on_success: Callable[[SkillRecord], None],
    should_stop: Callable[[], bool],
) -> None:
    """Run one job to a terminal state; a failing job never takes its worker down."""

    def progress(p: Progress) -> None:
        job.progress = {
            "step": p.step,
            "total": p.total,
            "loss": p.loss,
            "tokens_per_s": p.tokens_per_s,
            "eta_s": p.eta_s,
            "tokens": p.tokens,
        }
        if p.step == p.total or p.step % 10 == 0:
            loss = f", training loss={p.loss:.4f}" if p.loss is not None else ""
            job.log(
                f"Step {p.step}/{p.total}{loss}",
                kind="metrics",
                data={"step": p.step, "total_steps": p.total, "train_loss": p.loss, "tokens": p.tokens},
            )
            save(job)

    try:
        record = runner(job, examples, cfg, progress, should_stop)
    except Cancelled:
        finish(job, JobStatus.CANCELLED, None, None)
        return
    except QualityGateFailed as e:  # an expected outcome: the numbers go into the job, nothing was stored
        job.eval = e.report
        _log_gate(job, e.report)
        finish(job, JobStatus.FAILED, str(e), "quality_gate_failed")
        return
    except Exception as e:  # the full detail (paths, traceback) stays in the log; the job says what and why
        log.error("training job %s failed:\n%s", job.id, traceback.format_exc())
        code, message = describe(e)
        finish(job, JobStatus.FAILED, message, code)
        return
    finally:  # training is over, whatever its outcome: its freed activations' pages go back to the OS
        release_freed_memory()
    job.eval, job.skill_version = record.meta.get("eval"), record.version
    _log_gate(job, record.meta.get("quality") or {})
    try:
        on_success(record)
    except Exception as e:
        log.error("registering %s failed:\n%s", record.name, traceback.format_exc())
        finish(job, JobStatus.FAILED, f"stored as version {record.version} but not registered: {e}", "not_registered")
        return
    model = (job.fine_tuning or {}).get("fine_tuned_model") or record.name
    job.log(f"New fine-tuned model created: {model} (skill {record.name} v{record.version})")
    finish(job, JobStatus.SUCCEEDED, None, None)


def _log_gate(job: Job, report: dict[str, Any]) -> None:
    """The quality gate's numbers as an event: the new block against the base model and the trivial answer."""
    new = report.get("new") or {}
    if not new:
        return
    parts = [f"{k}={new[k]:.3f}" for k in ("score", "base_score", "trivial_score", "gain") if new.get(k) is not None]
    verdict = "passed" if report.get("passed") else "failed" + (" (forced)" if job.force else "")
    earlier = report.get("earlier") or {}
    drops = (
        f"; {len(earlier)} earlier skill(s) re-checked, largest drop {max(r['drop'] for r in earlier.values()):.3f}"
        if earlier
        else ""
    )
    job.log(
        f"Evaluation ({new.get('metric')}, {new.get('n')} held-out examples): {', '.join(parts)}{drops}; "
        f"quality gate {verdict}",
        level="info" if report.get("passed") or job.force else "warn",
        kind="metrics",
        data={"quality": report},
    )
