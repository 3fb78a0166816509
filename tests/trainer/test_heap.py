"""After a training job the freed heap goes back to the OS (glibc keeps it otherwise)."""

from __future__ import annotations

import os
import sys

import pytest

from skillpool.adapters_store.store import SkillRecord
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.heap import ENV, release_freed_memory
from skillpool.trainer.jobs.job import Job, run_job
from skillpool.trainer.loop import Cancelled
from skillpool.trainer.records import JobStatus

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc; trims glibc")

MB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fragment(keep: list[bytearray], mb: int = 200) -> None:
    """Allocate ~mb MB of 2 KB heap chunks and free all but every 64th: the freed pages lie between live
    chunks, so glibc cannot shrink the heap's top by itself, just as after a training step's activations."""
    chunks = [bytearray(2000) for _ in range(mb * MB // 2000)]
    keep.extend(chunks[::64])
    del chunks


def test_release_returns_the_freed_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    keep: list[bytearray] = []
    _fragment(keep)
    held = _rss()  # counts the freed chunks' pages (those of earlier tests' chunks too, if it reused them)
    assert release_freed_memory()
    assert held - _rss() > 100 * MB


@pytest.mark.parametrize("off", ["0", "false", "OFF"])
def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch, off: str) -> None:
    monkeypatch.setenv(ENV, off)
    keep: list[bytearray] = []
    _fragment(keep)
    held = _rss()
    assert not release_freed_memory()
    assert held - _rss() < 20 * MB  # nothing given back


@pytest.mark.parametrize(
    ("error", "status"),
    [(RuntimeError("out of data"), JobStatus.FAILED), (Cancelled(), JobStatus.CANCELLED)],
    ids=["failed", "cancelled"],
)
def test_run_job_gives_a_jobs_memory_back_whatever_its_outcome(
    monkeypatch: pytest.MonkeyPatch, error: Exception, status: JobStatus
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    keep: list[bytearray] = []
    finished: list[JobStatus] = []
    held: list[int] = []

    def runner(*_: object) -> SkillRecord:
        _fragment(keep)  # the job's transient allocations, freed when it ends
        held.append(_rss())
        raise error

    run_job(
        Job(id="job-1", skill="s", method="isolated", config={}),
        [],
        TrainConfig(),
        runner,
        save=lambda j: None,
        finish=lambda j, s, *_: finished.append(s),
        on_success=lambda r: None,
        should_stop=lambda: False,
    )
    assert finished == [status]
    assert held[0] - _rss() > 100 * MB
