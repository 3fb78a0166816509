"""A training job: its record, the queue protocol both queues keep, and how one job runs to its end.

States: validating → queued → running → succeeded | failed | cancelled. A job also keeps its events (OpenAI's
fine-tuning job events: state changes, training metrics, the quality gate's numbers), so they survive with the
record and reach every server through the shared queue. Whatever a job raises, it ends failed and its worker
lives on.
"""

from __future__ import annotations

import logging
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from skillpool.adapters_store.store import SkillRecord
from skillpool.runtime.openmp import in_own_thread

from ..config import TrainConfig
from ..heap import release_freed_memory
from ..loop import Cancelled, Progress
from ..quality import QualityGateFailed
from ..records import Example, JobStatus
from .failures import describe, redact_paths

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
    adapter: dict[str, Any] | None = None  # an import job: what intake found of its adapter (rank, modules, source)

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
# how an in-process job that the server's stop interrupted ends (a Redis job goes back to the queue instead)
SERVER_STOPPED = ("the server stopped before this job finished; create it again", "server_stopped")


def new_job_id() -> str:
    return "job-" + uuid.uuid4().hex[:20]


@dataclass(frozen=True)
class Room:
    """How many jobs that have not ended (validating, queued or running) a queue admits: `limit` in all, and with
    `per_key` at most that many of one owner (the jobs of callers without a key count as one owner's)."""

    limit: int
    per_key: int | None = None


class QueueFull(Exception):
    """A job not admitted: `pending` jobs have not ended, of the whole queue or (`per_key`) of the job's owner."""

    def __init__(self, pending: int, room: Room, per_key: bool) -> None:
        self.pending, self.room, self.per_key = pending, room, per_key
        most = room.per_key if per_key else room.limit
        whose = "of this key " if per_key else ""
        super().__init__(f"{pending} training jobs {whose}are pending (at most {most})")


def admits(room: Room, pending: list[str | None], owner: str | None) -> None:
    """Raise QueueFull unless a job of `owner` fits beside `pending` (the owners of the jobs not ended)."""
    if len(pending) >= room.limit:
        raise QueueFull(len(pending), room, per_key=False)
    if room.per_key is not None and (mine := pending.count(owner)) >= room.per_key:
        raise QueueFull(mine, room, per_key=True)


class JobQueue(Protocol):
    """What the API needs from a queue: LocalJobQueue (in-process) or RedisJobQueue (shared). `room`: admit the job
    only if it fits (QueueFull otherwise), checked and recorded in one step, so concurrent calls cannot overfill it;
    a job `add`ed with room keeps its place when it is submitted."""

    def submit(self, job: Job, examples: list[Example], cfg: TrainConfig, room: Room | None = None) -> Job: ...
    def add(self, job: Job, room: Room | None = None) -> Job: ...
    def update(self, job: Job) -> None: ...
    def get(self, job_id: str) -> Job | None: ...
    def list(self) -> list[Job]: ...
    def depth(self) -> int: ...
    def counts(self) -> tuple[int, int]: ...  # (queued, running): the metrics read them apart
    def cancel(self, job_id: str) -> Job | None: ...
    # stop training: the running job stops at its next check (in-process: it ends failed, server_stopped; Redis:
    # back to the queue); waits up to timeout_s for the trainer thread
    def close(self, timeout_s: float = 0.0) -> None: ...
    # job.skill for this job until it ends (trainer.jobs.reservations): None, or the id of the job that holds it
    def reserve(self, job: Job) -> str | None: ...
    def release(self, job: Job) -> None: ...  # a reservation whose job was never recorded (its creation failed)
    def trainer_alive(self) -> bool | None: ...  # this process' trainer thread runs; None: it runs none here


Runner = Callable[[Job, list[Example], TrainConfig, Callable[[Progress], None], Callable[[], bool]], SkillRecord]


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
        # a thread of its own: torch's thread pool ends with the job (runtime/openmp.py)
        record = in_own_thread(lambda: runner(job, examples, cfg, progress, should_stop), "skillpool-training")
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
    scored = (
        f"Evaluation ({new.get('metric')}, {new.get('n')} held-out examples): {', '.join(parts)}"
        if parts
        else "Evaluation: no held-out answers to score"  # an import whose examples carry none
    )
    job.log(
        f"{scored}{drops}; quality gate {verdict}",
        level="info" if report.get("passed") or job.force else "warn",
        kind="metrics",
        data={"quality": report},
    )
