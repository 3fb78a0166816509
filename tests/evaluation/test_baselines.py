"""Baseline sides beside the server's sequence (--parallel): a side that fails is reported between tasks."""

from __future__ import annotations

import time

import pytest

from skillpool.evaluation.baselines import Baselines, BaselineSides
from skillpool.trainer.config import TrainConfig


def test_a_failed_side_is_reported_between_tasks_not_after_the_sequence(tiny_base) -> None:  # type: ignore[no-untyped-def]
    bl = Baselines(tiny_base.path, TrainConfig())
    # "nope" is no baseline: its process fails at once, as one out of GPU memory would mid-run
    with BaselineSides(bl, ["nope"], [], parallel=True) as sides:
        deadline = time.time() + 120  # a spawned process imports torch and transformers first
        with pytest.raises(RuntimeError, match="the nope baseline failed: AttributeError"):
            while time.time() < deadline:
                sides.check()  # what the server's sequence calls after each task
                time.sleep(0.2)


def test_in_process_sides_run_when_their_results_are_asked_for(tiny_base) -> None:  # type: ignore[no-untyped-def]
    with BaselineSides(Baselines(tiny_base.path, TrainConfig()), [], [], parallel=True) as sides:
        sides.check()  # nothing started, nothing to report
        assert sides.results() == {}
    with BaselineSides(Baselines(tiny_base.path, TrainConfig()), ["nope"], [], parallel=False) as sides:
        sides.check()  # in-process: nothing runs before results()
        with pytest.raises(AttributeError):
            sides.results()


@pytest.mark.parametrize("parallel", [False, True])
def test_a_side_kept_from_a_cut_run_is_not_run_again(tiny_base, parallel: bool) -> None:  # type: ignore[no-untyped-def]
    # "nope" would fail if it ran (above); kept, its logged result is the side's result as it is
    kept = {"nope": [[100.0, 0.0]]}
    with BaselineSides(Baselines(tiny_base.path, TrainConfig()), ["nope"], [], parallel, kept) as sides:
        assert sides.kinds == [] and sides._pool is None  # no process started for it
        sides.check()
        assert sides.results() == kept
