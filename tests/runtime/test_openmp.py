"""How a skillpool process runs torch's CPU threads: OpenMP's idle threads spin briefly unless the user chose
otherwise, helper threads run torch on one thread, compute threads on the process' count, and a job run in a
thread of its own hands back its value or its exception."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch

from skillpool.runtime import openmp


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),
        ({"GOMP_SPINCOUNT": "5"}, {"GOMP_SPINCOUNT": "5"}),
    ],
)
def test_the_spin_default_yields_to_the_users_choice(env: dict[str, str], want: dict[str, str]) -> None:
    openmp.set_openmp_defaults(env)
    assert env == want


def test_the_console_script_sets_it_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import sys, os, skillpool.cli.main; print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [openmp.SPIN_COUNT, "False"]


def in_thread(fn: Callable[[], int]) -> int:
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(fn()))
    t.start()
    t.join()
    return got[0]


def test_helpers_run_on_one_thread_and_compute_threads_keep_the_process_count() -> None:
    start = torch.get_num_threads()
    try:
        openmp.set_compute_threads(2)

        def helper() -> int:
            openmp.as_helper_thread()
            return torch.get_num_threads()

        def compute() -> int:
            openmp.as_compute_thread()
            return torch.get_num_threads()

        assert in_thread(helper) == 1
        assert in_thread(torch.get_num_threads) == 1  # the hazard: a new thread takes the helper's count
        assert in_thread(compute) == 2
        assert openmp.in_own_thread(torch.get_num_threads, "t") == 2
    finally:
        openmp.set_compute_threads(start)


def test_a_compute_thread_keeps_its_count_when_a_helper_starts_before_its_first_torch_work() -> None:
    """The server's order: the engine's loop starts and waits for a request while the router's workers start; its
    first parallel work comes after theirs (torch sets a thread's count up lazily, from the last count set in any
    thread)."""
    start = torch.get_num_threads()
    ready, helped = threading.Event(), threading.Event()

    def compute() -> int:
        openmp.as_compute_thread()
        ready.set()
        helped.wait(timeout=10)
        return torch.get_num_threads()

    def helper() -> None:
        ready.wait(timeout=10)
        openmp.as_helper_thread()
        helped.set()

    try:
        openmp.set_compute_threads(2)
        t = threading.Thread(target=helper)
        t.start()
        assert in_thread(compute) == 2
        t.join()
    finally:
        openmp.set_compute_threads(start)


def test_a_job_in_its_own_thread_returns_its_value_or_raises_its_error() -> None:
    assert openmp.in_own_thread(lambda: threading.current_thread().name, "skillpool-test-job") == "skillpool-test-job"

    def fail() -> None:
        raise ValueError("the job's own error")

    with pytest.raises(ValueError, match="the job's own error"):
        openmp.in_own_thread(fail, "skillpool-test-job")
