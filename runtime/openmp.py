"""How a skillpool process runs torch's CPU threads.

OpenMP's idle threads spin briefly, then sleep (set before torch loads): sleeping at once (OMP_WAIT_POLICY=PASSIVE)
pays a wake-up in each of a decode step's hundreds of parallel regions, spinning on (ACTIVE) takes the cores from
everything else. libgomp spins only ~100 times while more of its threads are alive than there are cores, and a
thread that ever ran a parallel region keeps its pool until it exits, so only the compute threads (the engine's
loop, a training job) run torch on several threads; helper threads (the router's MiniLM) run it on one, and a
training job runs in a thread of its own that ends with the job. Measured: load_tests/probes/bench_omp_wait.py.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")
SPIN_COUNT = "10000"  # GOMP_SPINCOUNT: tens of microseconds, longer than the gaps between a step's regions
_compute: list[int] = []  # the compute threads' count, kept before a helper thread lowers torch's default


def openmp_defaults() -> dict[str, str]:
    """The variables `set_openmp_defaults` sets (a Ray worker's environment gets them too)."""
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


def set_openmp_defaults(env: MutableMapping[str, str] = os.environ) -> None:
    """Before torch loads; either variable set by the user wins."""
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env.update(openmp_defaults())


def set_compute_threads(n: int) -> None:
    """This thread and every compute thread run torch on `n` threads (--threads)."""
    import torch

    torch.set_num_threads(n)
    _compute[:] = [n]


def compute_threads() -> int:
    """The threads a compute thread runs torch on: --threads, else torch's default as first seen. (A new thread
    takes the count of the last `torch.set_num_threads` in any thread, so a helper's 1 would reach it.)"""
    if not _compute:
        import torch

        _compute.append(torch.get_num_threads())
    return _compute[0]


def _set_this_thread(n: int) -> None:
    import torch

    # torch sets a thread's count up on its first query or parallel work, to the last count set in ANY thread:
    # done first here, so that a later setting elsewhere (a helper's 1) cannot replace this thread's own
    torch.get_num_threads()
    torch.set_num_threads(n)


def as_compute_thread() -> None:
    _set_this_thread(compute_threads())


def as_helper_thread() -> None:
    """This thread runs torch on one thread: no OpenMP pool of its own to outlive its work."""
    compute_threads()  # kept before this lowers the default of threads that start later
    _set_this_thread(1)


def in_own_thread(fn: Callable[[], T], name: str) -> T:
    """`fn()` as a compute thread of its own, joined: its OpenMP pool ends with it. Its exception is raised here."""
    out: list[Any] = []

    def run() -> None:
        as_compute_thread()
        try:
            out.append((True, fn()))
        except BaseException as e:  # handed to the caller, which decides
            out.append((False, e))

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
