"""The job runner: an in-process trainer yields to serving; a retried job reuses what it stored."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from skillpool.adapters_store.store import SkillStore
from tests.adapters_store.test_store import draft


class _Steps:
    """Stands in for SkillTrainer.run where only its calling pattern matters: the loop asks `should_stop`
    before each optimizer step, exactly as TrainLoop.step does."""

    def __init__(self, busy: object, store: SkillStore) -> None:
        self.busy, self.store, self.steps_while_busy = busy, store, []  # type: ignore[var-annotated]
        self.runs = 0

    def run(self, skill, examples, cfg, method, report, should_stop, force, extra_meta):  # type: ignore[no-untyped-def]
        self.runs += 1
        for _ in range(3):
            assert not should_stop()
            self.steps_while_busy.append(self.busy.is_set())  # type: ignore[attr-defined]
        return self.store.write(replace(draft(skill), meta={**draft(skill).meta, **extra_meta}))


def test_an_in_process_trainer_yields_its_steps_to_serving_but_not_forever(tmp_path: Path) -> None:
    import threading

    from skillpool.trainer.config import TrainConfig
    from skillpool.trainer.jobs.job import Job
    from skillpool.trainer.jobs.runner import make_runner

    job = Job(id="job-1", skill="s", method="isolated", config={})
    busy = threading.Event()
    busy.set()
    steps = _Steps(busy, SkillStore(tmp_path))
    threading.Timer(0.3, busy.clear).start()  # serving goes idle a moment later
    make_runner(steps, None, busy.is_set, max_yield_s=120)(job, [], TrainConfig(), print, lambda: False)  # type: ignore[arg-type]
    assert steps.steps_while_busy == [False, False, False]  # no step ran while requests were being served
    busy.set()  # serving never goes idle: each step waits at most max_yield_s, so training still ends
    steps = _Steps(busy, SkillStore(tmp_path / "other"))
    make_runner(steps, None, busy.is_set, max_yield_s=0.05)(job, [], TrainConfig(), print, lambda: False)  # type: ignore[arg-type]
    assert steps.steps_while_busy == [True, True, True]


def test_a_retried_job_reuses_the_version_its_earlier_try_stored(tmp_path: Path) -> None:
    """A worker that died after storing but before ending the job: the retry returns that version, trains nothing."""
    import threading

    from skillpool.trainer.config import TrainConfig
    from skillpool.trainer.jobs.job import Job
    from skillpool.trainer.jobs.runner import make_runner

    steps = _Steps(threading.Event(), SkillStore(tmp_path))
    runner = make_runner(steps)  # type: ignore[arg-type]
    job = Job(id="job-1", skill="s", method="isolated", config={})
    first = runner(job, [], TrainConfig(), print, lambda: False)
    again = runner(job, [], TrainConfig(), print, lambda: False)
    assert steps.runs == 1 and (first.version, again.version) == (1, 1) and again.meta["training_job"] == "job-1"
    other = runner(Job(id="job-2", skill="s", method="isolated", config={}), [], TrainConfig(), print, lambda: False)
    assert steps.runs == 2 and other.version == 2  # another job trains a new version as before
