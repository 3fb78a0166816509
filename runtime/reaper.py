"""The reaper: a small process that stops what a skillpool process started once that process is gone, however it
died (SIGKILL, the OOM killer).

For processes that are not ours to configure: a local Ray's (`skillpool serve --replicas`). Ray ends its GCS and
raylet with the process that started them, but its dashboard and runtime-env agents wait for the GCS to flush their
logs first: over a minute after a SIGKILL. The reaper records its parent's descendants every POLL_S and, once the
parent has exited, stops those still running (SIGTERM, SIGKILL after GRACE_S). On a clean stop the parent stops them
(and the reaper with them) itself. Run as `python -m skillpool.runtime.reaper PID`; `start_reaper()` starts it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from .processes import alive, stop_processes

POLL_S = 1.0
GRACE_S = 3.0


def start_reaper() -> subprocess.Popen[bytes]:
    """A reaper for this process (its child, so it is among the descendants a clean stop ends)."""
    return subprocess.Popen([sys.executable, "-m", "skillpool.runtime.reaper", str(os.getpid())])


def reap(parent_pid: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> int:
    """Watch `parent_pid` until it exits, then stop what it had started; how many were still running."""
    me = os.getpid()
    try:
        parent = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return 0
    seen: dict[int, psutil.Process] = {}
    while alive(parent):  # the same process (psutil checks its start time: a reused pid is not it)
        try:
            seen.update({p.pid: p for p in parent.children(recursive=True) if p.pid != me})
        except psutil.NoSuchProcess:
            break
        time.sleep(poll_s)
    left = [p for p in seen.values() if alive(p)]
    if left:
        print(
            f"skillpool: process {parent_pid} is gone; stopping the {len(left)} process(es) it started",
            file=sys.stderr,
            flush=True,
        )
        stop_processes(left, grace_s)
    return len(left)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl+C goes to the parent, which stops cleanly
    reap(int(sys.argv[1]))


if __name__ == "__main__":
    main()
