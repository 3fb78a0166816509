"""A cancel is honoured within seconds at every stage, key preparation and its embedding included (it used to
be checked only between optimizer steps: a job cancelled 2 s after upload ran 277 s more)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from skillpool.adapters_store.store import SkillRecord, SkillStore
from skillpool.router import Router
from skillpool.router.embedder import Embedder
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.jobs.job import Job, new_job_id
from skillpool.trainer.jobs.local_queue import LocalJobQueue
from skillpool.trainer.jobs.runner import make_runner
from skillpool.trainer.loop import Cancelled, stop_check
from skillpool.trainer.records import TERMINAL, JobStatus
from skillpool.trainer.skill_trainer import SkillTrainer
from tests.conftest import until
from tests.datasets import read_task


def test_key_preparation_checks_between_embedding_chunks(embedder) -> None:  # type: ignore[no-untyped-def]
    texts = [e["route_text"] for e in read_task("long_sequence", "sst-2", "train", 600)]
    calls: list[float] = []

    def check() -> None:  # the third check cancels: two chunks of 64 embedded, not 600 texts
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise Cancelled()

    with pytest.raises(Cancelled):
        Router(embedder).prepare_keys(texts, check_stop=check)
    assert len(calls) == 3


def test_stop_check_asks_at_most_once_a_period() -> None:
    asked: list[int] = []
    check = stop_check(lambda: bool(asked.append(1)) or len(asked) >= 2, every_s=0.2)
    check()
    check()  # within the period: not asked again
    assert len(asked) == 1
    time.sleep(0.2)  # the period itself is under test: it must pass before the next check asks
    with pytest.raises(Cancelled):
        check()
    assert stop_check(None)() is None  # nothing to ask: never stops


class CountingEmbedder:
    """The real embedder, counting its calls: a trainer that made one is embedding the upload."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder, self.dim, self.model_id, self.calls = embedder, embedder.dim, embedder.model_id, 0

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        return self.embedder.embed(texts)


def test_a_job_cancelled_during_key_preparation_ends_within_seconds(tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """1,000 sst-2 rows: about 45 s of key preparation on two busy cores before training could start."""
    examples = read_task("long_sequence", "sst-2", "train", 1000)
    counting = CountingEmbedder(embedder)
    trainer = SkillTrainer(SkillStore(tmp_path), Router(counting), tiny_base)
    q = LocalJobQueue(tmp_path / "jobs", make_runner(trainer), lambda _: None)
    before = counting.calls
    try:
        job = q.submit(Job(id=new_job_id(), skill="sst-2", method="isolated", config={}), examples, TrainConfig())
        until(lambda: counting.calls > before)  # inside key preparation (embedding the upload)
        cancelled = time.monotonic()
        q.cancel(job.id)
        until(lambda: job.status in TERMINAL, timeout=60)
        took = time.monotonic() - cancelled
        assert job.status == JobStatus.CANCELLED and took < 20, f"{job.status} after {took:.1f} s"
        assert job.progress["step"] == 0  # never reached training
        assert trainer.store.get("sst-2") is None and list(trainer.store.tmp_dir.iterdir()) == []
    finally:
        q.close()


class _CancelFirst:
    """The queue's lock, except that the worker's first try to take it lets `cancel` run in another thread and
    land first: the widest a cancel racing the worker's start of a job can be."""

    def __init__(self, lock: threading.Lock, worker: threading.Thread, cancel: Callable[[], object]) -> None:
        self._lock, self._worker = lock, worker
        self._cancel: Callable[[], object] | None = cancel

    def __enter__(self) -> bool:
        if self._cancel is not None and threading.current_thread() is self._worker:
            racer, self._cancel = threading.Thread(target=self._cancel), None
            racer.start()
            racer.join(5)
        return self._lock.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._lock.__exit__(*exc)


def test_a_cancel_racing_the_workers_start_is_never_undone(tmp_path: Path) -> None:
    release = threading.Event()

    def runner(job: Job, examples: object, cfg: object, progress: object, stop: Callable[[], bool]) -> SkillRecord:
        while not release.wait(0.05):
            if stop():
                raise Cancelled
        return SkillRecord(job.skill, 1, tmp_path, {})

    q = LocalJobQueue(tmp_path / "jobs", runner, lambda _: None)
    try:
        first, raced = (Job(id=new_job_id(), skill=s, method="isolated", config={}) for s in ("first", "raced"))
        q.submit(first, [], TrainConfig())  # holds the worker while the lock is swapped
        until(lambda: first.status == JobStatus.RUNNING, 20)
        q.submit(raced, [], TrainConfig())
        q._lock = _CancelFirst(q._lock, q._thread, lambda: q.cancel(raced.id))  # type: ignore[assignment]
        release.set()
        until(lambda: raced.status in TERMINAL, 20)
        time.sleep(0.5)  # past the worker's start: a cancel it undid would show as running by now
        assert raced.status == JobStatus.CANCELLED and raced.started_at is None
    finally:
        release.set()
        q.close(5)
