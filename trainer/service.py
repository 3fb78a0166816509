"""What a serving process takes from the trainer, in one place: the jobs and their queue, the skill trainer
and its runner, the training metrics, the skill-event bus, and the flags a server shares with `skillpool worker`.

The server imports this module (and trainer.config, trainer.datasets, trainer.events), never the trainer's
other modules: an import-linter contract in pyproject.toml keeps it so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from skillpool.adapters_store.store import SkillRecord

from .bus import LocalEventBus, RedisEventBus, SkillEventBus, announcer, make_event_bus
from .jobs.failures import describe
from .jobs.job import Job, JobQueue, QueueFull, Room, Runner, new_job_id
from .jobs.local_queue import LocalJobQueue
from .jobs.metrics import Catalog, TrainingMetrics
from .jobs.redis_queue import RedisJobQueue
from .jobs.runner import TrainingObserver, make_runner
from .judge import Prompt
from .keys import DEFAULT_PREFIX
from .methods import method_error
from .records import TERMINAL, Example, JobStatus
from .skill_trainer import SkillTrainer

__all__ = [
    "DEFAULT_PREFIX",
    "Catalog",
    "TERMINAL",
    "Example",
    "Job",
    "JobQueue",
    "JobStatus",
    "LocalEventBus",
    "Prompt",
    "QueueFull",
    "RedisEventBus",
    "Room",
    "SkillEventBus",
    "SkillTrainer",
    "TrainingMetrics",
    "TrainingObserver",
    "announcer",
    "describe",
    "make_event_bus",
    "make_job_queue",
    "make_runner",
    "method_error",
    "new_job_id",
]


def make_job_queue(
    redis_url: str | None,
    jobs_dir: Path,
    runner: Runner | None,
    on_success: Callable[[SkillRecord], None],
    on_finish: Callable[[Job], None] | None = None,
    prefix: str = DEFAULT_PREFIX,
) -> JobQueue:
    """The queue a server builds once at start-up: the Redis one with a URL (`runner` None: it only enqueues,
    workers train), else the in-process one under `jobs_dir`, which needs a runner."""
    if redis_url:
        return RedisJobQueue(redis_url, runner, on_success, on_finish, prefix)
    if runner is None:
        raise ValueError("without a Redis URL this server must run the trainer itself")
    return LocalJobQueue(jobs_dir, runner=runner, on_success=on_success, on_finish=on_finish)
