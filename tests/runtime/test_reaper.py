"""The reaper stops what its parent started once the parent is SIGKILLed: children and grandchildren, those that
ignore SIGTERM and those that left its session included, and then it exits itself."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import psutil

from skillpool.runtime.processes import alive
from tests.conftest import until

PARENT = """
import subprocess, sys, time
from skillpool.runtime.reaper import start_reaper
reaper = start_reaper()
# a child that ignores SIGTERM (so do its children), and a grandchild in a session of its own
shell = subprocess.Popen(["bash", "-c", "trap '' TERM; setsid sleep 300 & sleep 300"])
time.sleep(2)  # the reaper has seen them all
print(reaper.pid, flush=True)
time.sleep(300)
"""


def test_the_reaper_stops_what_a_sigkilled_parent_started() -> None:
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PARENT)], stdout=subprocess.PIPE, text=True)
    procs: list[psutil.Process] = []
    try:
        assert parent.stdout is not None
        reaper = psutil.Process(int(parent.stdout.readline()))
        procs = psutil.Process(parent.pid).children(recursive=True)
        assert reaper in procs and len(procs) == 4  # the reaper, bash, its two sleeps
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        until(lambda: not any(alive(p) for p in procs), timeout=15)  # its poll, then SIGTERM, then SIGKILL
    finally:
        for p in procs:
            if alive(p):
                p.kill()
