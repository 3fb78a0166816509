"""The processes below a command end with it: a process that ignores SIGTERM is killed after the grace, a second
stop signal exits at once taking the children along, and a multiprocessing child that asked to die with its parent
does so when that parent is SIGKILLed. Real processes throughout (`sleep`, Python children)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from skillpool.runtime.processes import alive, descendants, shutdown_timeout, stop_processes
from tests.conftest import until


def python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def pids_from(proc: subprocess.Popen[str], n: int) -> list[int]:
    """The first `n` lines the child prints, as pids (it prints them once they run)."""
    assert proc.stdout is not None
    return [int(proc.stdout.readline()) for _ in range(n)]


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    stubborn = python(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    )
    polite = subprocess.Popen(["sleep", "60"])
    try:
        pids_from(stubborn, 1)  # its handler is in place
        procs = [psutil.Process(stubborn.pid), psutil.Process(polite.pid)]
        killed = stop_processes(procs, grace_s=0.5)
        assert [p.pid for p in killed] == [stubborn.pid]  # the polite one ended on SIGTERM
        # the stop reaped its own children: psutil has their status
        assert [p.returncode for p in procs] == [-signal.SIGKILL, -signal.SIGTERM]  # type: ignore[attr-defined]
    finally:
        for p in (stubborn, polite):
            p.kill()
            p.wait()


def test_descendants_are_children_and_grandchildren() -> None:
    parent = python(
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
        print(child.pid, flush=True); print(child.stdout.readline().strip(), flush=True); time.sleep(60)
        """
    )
    try:
        child, grandchild = pids_from(parent, 2)
        assert {p.pid for p in descendants(parent.pid)} == {child, grandchild}
        stop_processes(descendants(parent.pid), grace_s=2)
        assert not any(alive(psutil.Process(p)) for p in (child, grandchild) if psutil.pid_exists(p))
    finally:
        parent.kill()
        parent.wait()


SIGNALLED = """
import multiprocessing, subprocess, sys, time
from multiprocessing import shared_memory
from skillpool.runtime.processes import on_stop_signals

if __name__ == "__main__":
    child = subprocess.Popen(["sleep", "60"])
    # as vLLM's processes: shared memory (which starts CPython's resource tracker) and a spawned child holding it
    memory = shared_memory.SharedMemory(create=True, size=4096)
    spawned = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    spawned.start()
    on_stop_signals(lambda sig: print("first", sig, flush=True))
    print(child.pid, spawned.pid, memory.name, flush=True)
    time.sleep(60)
"""


def test_the_first_stop_signal_begins_a_stop_and_a_second_exits_at_once_with_the_children(tmp_path: Path) -> None:
    script = tmp_path / "signalled.py"
    script.write_text(SIGNALLED)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        child, spawned, memory = proc.stdout.readline().split()
        below = descendants(proc.pid)  # the sleep, the spawned child, the resource tracker
        assert {int(child), int(spawned)} < {p.pid for p in below} and len(below) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().split() == ["first", str(int(signal.SIGTERM))]
        assert proc.poll() is None and all(alive(p) for p in below)  # the first only begins a stop
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 128 + signal.SIGINT  # as a shell reports a process a signal ended
        until(lambda: not any(alive(p) for p in below), timeout=10)
        assert "second SIGINT" in (proc.stderr.read() if proc.stderr else "")
        assert not Path("/dev/shm", memory).exists()  # the tracker removed what its holders left
    finally:
        proc.kill()
        proc.wait()


ORPHANED = """
import multiprocessing, os, sys, time
from skillpool.runtime.processes import DIE_WITH_PARENT, die_with_parent_if_asked

def child(asks):
    if asks:
        die_with_parent_if_asked()
    time.sleep(60)

if __name__ == "__main__":
    os.environ[DIE_WITH_PARENT] = "1"
    ctx = multiprocessing.get_context("spawn")  # as vLLM starts its engine core
    procs = [ctx.Process(target=child, args=(asks,)) for asks in (True, False)]
    for p in procs:
        p.start()
    time.sleep(3)  # both have run their first lines
    print(procs[0].pid, procs[1].pid, flush=True)
    time.sleep(60)
"""


def test_a_child_that_asked_dies_with_its_sigkilled_parent(tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    script = tmp_path / "orphans.py"
    script.write_text(ORPHANED)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    asked = ignored = None
    try:
        assert parent.stdout is not None
        asked, ignored = map(int, parent.stdout.readline().split())
        parent.kill()
        parent.wait()
        until(lambda: not psutil.pid_exists(asked) or not alive(psutil.Process(asked)), timeout=10)
        time.sleep(0.5)
        assert alive(psutil.Process(ignored))  # the control: without asking, an orphan lives on
    finally:
        for pid in (asked, ignored):
            if pid is not None and psutil.pid_exists(pid):
                psutil.Process(pid).kill()


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "soon"])
def test_a_shutdown_timeout_must_be_a_finite_number_of_seconds(text: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="finite|at least 0|not a number"):
        shutdown_timeout(text)
    assert shutdown_timeout("0") == 0.0 and shutdown_timeout("2.5") == 2.5
