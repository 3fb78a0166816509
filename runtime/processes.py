"""The processes a skillpool command starts, and how they end with it.

`skillpool serve` and `skillpool worker` stop every process below them before they exit (`stop_descendants`), and
a process started for them ends by itself when its parent dies, even by SIGKILL (`die_with_parent`, Linux's
PR_SET_PDEATHSIG, as Ray does for the processes of a local cluster). vLLM's engine core and workers ask for it
through the environment (`DIE_WITH_PARENT`), which they inherit.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

import psutil

from .flags import number

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SHUTDOWN_TIMEOUT_S = 20.0  # --shutdown-timeout's default: the drain, with the close after it, fits Kubernetes' 30 s
FORCED_GRACE_S = 2.0  # a second signal: how long the processes below get between SIGTERM and SIGKILL
DIE_WITH_PARENT = "SKILLPOOL_DIE_WITH_PARENT"  # "1": a multiprocessing child ends when its parent does
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


shutdown_timeout = number(float, lo=0)  # --shutdown-timeout's value: seconds, finite and not negative


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """Every live process below `pid` (default: this one), children first."""
    try:
        return psutil.Process(pid if pid is not None else os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive(p: psutil.Process) -> bool:
    """Running, and not a zombie (a zombie has exited: only its parent's wait is missing)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_each(procs: list[psutil.Process], sig: int) -> list[psutil.Process]:
    sent = []
    for p in procs:
        try:
            p.send_signal(sig)  # psutil checks the pid still names the process it found (no pid reuse)
            sent.append(p)
        except psutil.NoSuchProcess:
            pass
        except psutil.AccessDenied as e:  # not ours to stop (another user's): say so, go on
            log.warning("cannot signal process %d: %s", p.pid, e)
    return sent


def stop_processes(procs: list[psutil.Process], grace_s: float) -> list[psutil.Process]:
    """SIGTERM each, wait up to `grace_s` for them to exit, then SIGKILL the rest; returns those killed."""
    sent = _signal_each([p for p in procs if alive(p)], signal.SIGTERM)
    _, left = psutil.wait_procs(sent, timeout=max(grace_s, 0.0))
    left = [p for p in left if alive(p)]
    for p in left:
        log.warning("process %d (%s) outlived SIGTERM by %g s: killed", p.pid, _name(p), grace_s)
    _signal_each(left, signal.SIGKILL)
    psutil.wait_procs(left, timeout=5)
    return left


def stop_descendants(grace_s: float) -> list[psutil.Process]:
    """Stop every process below this one (see stop_processes); returns those that had to be killed. The
    multiprocessing resource tracker goes last, its own way: it ignores SIGTERM, and it exits by itself, after
    removing the shared memory the others left, once every process holding its pipe has closed it."""
    tracker = _resource_tracker_pid()
    killed = stop_processes([p for p in descendants() if p.pid != tracker], grace_s)
    _close_resource_tracker()
    return killed + stop_processes(descendants(), grace_s)


def _resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    pid = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)
    return pid if isinstance(pid, int) else None


def _close_resource_tracker() -> None:
    """Close this process' end of the tracker's pipe (CPython keeps it in private fields: a best effort), so that
    the tracker, its other holders stopped, cleans up and exits; stop_processes then waits for it."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    fd = getattr(tracker, "_fd", None)
    if not isinstance(fd, int):
        return
    try:
        os.close(fd)
    except OSError as e:
        log.debug("resource tracker: %s", e)
    tracker._fd = None  # type: ignore[union-attr]  # as its own _stop() leaves it


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


def exit_now(sig: int = signal.SIGTERM, grace_s: float = FORCED_GRACE_S) -> NoReturn:
    """Stop at once: every process below this one (SIGTERM, SIGKILL after `grace_s`), then this one, with the
    status a shell gives a process ended by `sig` (128 + sig). No cleanup of this process runs."""
    try:
        stop_descendants(grace_s)
    finally:
        sys.stderr.flush()
        os._exit(128 + int(sig))


def on_stop_signals(first: Callable[[int], None]) -> None:
    """SIGTERM and SIGINT (from the main thread): the first calls `first(signal)`, which begins a clean stop;
    any later one is `exit_now`, taking the processes below with it."""
    seen: list[int] = []

    def handle(sig: int, _frame: object) -> None:
        if seen:
            print(f"second {signal.Signals(sig).name}: stopping now", file=sys.stderr, flush=True)
            exit_now(sig)
        seen.append(sig)
        first(sig)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send this process `sig` when the thread that started it ends (its parent SIGKILLed
    included), and send it now if `parent_pid` is gone already. False where Linux's prctl is missing."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(err))
        return False
    if os.getppid() != parent_pid:  # it died before the prctl: no signal will come
        os.kill(os.getpid(), sig)
    return True


def die_with_parent_if_asked() -> bool:
    """In a multiprocessing child whose environment has DIE_WITH_PARENT=1: die_with_parent(its parent), by
    SIGKILL. Its parent is gone, so nothing waits for a clean teardown, and a busy process (a vLLM worker in the
    middle of a step on shared cores) took over 10 s to honour SIGTERM; the kernel frees its memory, and the
    multiprocessing resource tracker, once its last holder is gone, the shared memory it left."""
    parent = multiprocessing.parent_process()
    if os.environ.get(DIE_WITH_PARENT) != "1" or parent is None or parent.pid is None:
        return False
    return die_with_parent(parent.pid, signal.SIGKILL)
