"""The training metrics, declared once: the server's /metrics and `skillpool worker --metrics-port` both export
them from a `TrainingMetrics` on their own registry.

Counts that a queue can answer (queued, running, whether its trainer thread runs) are read from the queue when
Prometheus scrapes, so they are never stale; a running job's progress is set by the runner and removed when the
job ends, so a finished job leaves no series behind.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric

from ..loop import Progress
from ..records import TERMINAL
from .job import Job, JobQueue

log = logging.getLogger(__name__)

# exposition name -> (type, labels): what the metrics table in deploy/README.md is checked against
Catalog = dict[str, tuple[str, tuple[str, ...]]]

_QUEUED = ("skillpool_training_jobs_queued", "Training jobs waiting for a trainer (the whole shared queue)")
_RUNNING = ("skillpool_training_jobs_running", "Training jobs a trainer has claimed (the whole shared queue)")
_UP = ("skillpool_trainer_up", "1 while this process' trainer thread (or worker loop) runs, 0 once it died")


class TrainingMetrics:
    """Training jobs and their progress as Prometheus series on `registry`; a `runner.TrainingObserver`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.jobs = Counter("skillpool_training_jobs", "Training jobs ended, by status", ["status"], registry=registry)
        for status in sorted(s.value for s in TERMINAL):  # at 0 from the start: increase() sees a process's first end
            self.jobs.labels(status)
        self.step = Gauge("skillpool_training_step", "The running job's optimizer step", ["skill"], registry=registry)
        self.steps = Gauge(
            "skillpool_training_steps", "The running job's planned optimizer steps", ["skill"], registry=registry
        )
        self.loss = Gauge("skillpool_training_loss", "The running job's smoothed loss", ["skill"], registry=registry)
        self.tokens_per_s = Gauge(
            "skillpool_training_tokens_per_second", "The running job's throughput", ["skill"], registry=registry
        )
        self._queue = _QueueCollector()
        registry.register(self._queue)
        self.catalog: Catalog = {
            "skillpool_training_jobs_total": ("counter", ("status",)),
            **{
                f"skillpool_training_{n}": ("gauge", ("skill",)) for n in ("step", "steps", "loss", "tokens_per_second")
            },
            _QUEUED[0]: ("gauge", ()),
            _RUNNING[0]: ("gauge", ()),
            _UP[0]: ("gauge", ("queue",)),
        }

    def watch(self, queue: JobQueue, kind: str) -> None:
        """Report this queue's queued and running jobs, and its trainer thread as `trainer_up{queue=kind}`."""
        self._queue.queue, self._queue.kind = queue, kind

    # --- runner.TrainingObserver ---------------------------------------------------------------
    def training_progress(self, skill: str, p: Progress) -> None:
        self.step.labels(skill).set(p.step)
        self.steps.labels(skill).set(p.total)
        if p.loss is not None:  # a step without a loss (a replay step) keeps the last one
            self.loss.labels(skill).set(p.loss)
        self.tokens_per_s.labels(skill).set(p.tokens_per_s)

    def training_ended(self, skill: str) -> None:
        """The job training `skill` is over, whatever its outcome: its progress series go."""
        for gauge in (self.step, self.steps, self.loss, self.tokens_per_s):
            try:
                gauge.remove(skill)
            except KeyError:  # never set: the job ended before its first step
                pass

    def job_ended(self, job: Job) -> None:
        """A queue's `on_finish`: count the ending once, in the process that ended the job."""
        self.jobs.labels(job.status.value).inc()
        self.training_ended(job.skill)


class _QueueCollector:
    """Reads the watched queue at scrape time. A queue that cannot be read (Redis down) drops only its counts."""

    def __init__(self) -> None:
        self.queue: JobQueue | None = None
        self.kind = ""

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(*_QUEUED), GaugeMetricFamily(*_RUNNING), GaugeMetricFamily(*_UP, labels=["queue"])]

    def collect(self) -> Iterator[Metric]:
        if self.queue is None:
            return
        try:
            queued, running = self.queue.counts()
        except Exception as e:  # every other series still matters
            log.warning("/metrics: training job counts unavailable: %s", e)
        else:
            yield GaugeMetricFamily(*_QUEUED, value=queued)
            yield GaugeMetricFamily(*_RUNNING, value=running)
        alive = self.queue.trainer_alive()
        if alive is not None:  # no series where no trainer runs (a server whose Redis workers train)
            up = GaugeMetricFamily(*_UP, labels=["queue"])
            up.add_metric([self.kind], 1.0 if alive else 0.0)
            yield up
