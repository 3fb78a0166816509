"""The hf engine thread's priority on a CPU: below routing and HTTP, which a request's first token waits on."""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by `nice` (Linux: nice is per thread, and the torch threads this
    thread starts inherit it). Decode steps then yield the cores to routing and HTTP, which are short and what
    a request's time to first token waits on; alone on the cores they run as fast as before."""
    if nice <= 0 or not sys.platform.startswith("linux"):  # elsewhere PRIO_PROCESS would name a process, not us
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (OSError, AttributeError) as e:  # not Linux, or not allowed: run at the same priority
        log.warning("could not lower the engine thread's priority: %s", e)
