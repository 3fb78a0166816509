"""The job runner: how a job queue (local or Redis) runs one job on a `SkillTrainer`: a training job, or an import
job (method "imported") that adopts the adapter intake staged for it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from skillpool.adapters_store.store import SkillRecord

from ..config import IMPORTED, TrainConfig
from ..loop import Progress
from ..records import Example
from ..skill_trainer import SkillTrainer
from .job import Job, Runner


class TrainingObserver(Protocol):
    """Watches training progress; trainer.jobs.metrics.TrainingMetrics is one (its Prometheus gauges)."""

    def training_progress(self, skill: str, p: Progress) -> None: ...

    def training_ended(self, skill: str) -> None: ...  # whatever the outcome: its progress is over


def make_runner(
    trainer: SkillTrainer,
    observer: TrainingObserver | None = None,
    busy: Callable[[], bool] | None = None,
    max_yield_s: float = 2.0,
) -> Runner:
    """A job runner for this trainer. `busy`: whether serving has requests running or waiting; an in-process
    trainer then waits before each optimizer step (at most `max_yield_s` a step, so it still progresses under
    constant load): on shared cores chat's next token comes first."""

    def run(job: Job, examples, train_cfg, progress, should_stop) -> SkillRecord:  # type: ignore[no-untyped-def]
        def stop_or_yield() -> bool:
            deadline = time.monotonic() + max_yield_s
            while busy is not None and busy() and time.monotonic() < deadline and not should_stop():
                time.sleep(0.02)
            return bool(should_stop())

        def report(p):  # type: ignore[no-untyped-def]
            progress(p)
            if observer is not None:
                observer.training_progress(job.skill, p)

        # a retried job (its worker died after storing) finds the version it wrote: a version is written once
        done = next((r for r in trainer.store.versions(job.skill) if r.meta.get("training_job") == job.id), None)
        if done is not None:
            return done
        alias = (job.fine_tuning or {}).get("fine_tuned_model")  # the OpenAI model id the skill answers to
        extra: dict[str, Any] = {"training_job": job.id}
        if job.owner is not None:  # the key name that trained it: a train key extends only its own skills
            extra["owner"] = job.owner
        if alias:
            extra |= {"fine_tuned_model": alias, "fine_tuning_job": job.id}
        try:
            if job.method == IMPORTED:
                return _adopt(trainer, job, examples, train_cfg, stop_or_yield, extra)
            return trainer.run(
                job.skill, examples, train_cfg, job.method, report, stop_or_yield, force=job.force, extra_meta=extra
            )
        finally:  # succeeded, failed or cancelled: a job that no longer trains leaves no progress series
            if observer is not None:
                observer.training_ended(job.skill)

    return run


class StagedAdapterGone(FileNotFoundError):
    """An import job whose checked adapter is no longer staged (the server that took it stopped before it ran)."""


def _adopt(
    trainer: SkillTrainer,
    job: Job,
    examples: list[Example],
    cfg: TrainConfig,
    should_stop: Callable[[], bool],
    extra: dict[str, Any],
) -> SkillRecord:
    """An import job: its adapter, checked and staged at intake (store.stage under the job's id), becomes the skill;
    the staged files go whatever the outcome."""
    folder = trainer.store.staged(job.id)
    if folder is None:
        raise StagedAdapterGone(
            f"the adapter of import job {job.id} is no longer staged (the server that accepted it stopped): import it "
            "again"
        )
    try:
        return trainer.adopt(job.skill, folder, examples, cfg, should_stop, job.force, extra, job.adapter)
    finally:
        trainer.store.unstage(job.id)
