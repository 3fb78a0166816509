"""The hf engine's thread runs its decode steps at a lower priority than routing and HTTP on a CPU."""

from __future__ import annotations

import os
import threading

from skillpool.server.engines.hf import lower_priority


def nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_thread_and_the_threads_it_starts_run_lower_and_others_do_not() -> None:
    seen: dict[str, int] = {}

    def engine() -> None:
        seen["before"] = nice_of_this_thread()
        lower_priority(3)
        seen["after"] = nice_of_this_thread()
        child = threading.Thread(target=lambda: seen.__setitem__("child", nice_of_this_thread()))
        child.start()
        child.join()

    t = threading.Thread(target=engine)
    t.start()
    t.join()
    assert seen["after"] == min(19, seen["before"] + 3)
    assert seen["child"] == seen["after"]  # torch's worker threads start from the engine thread
    assert nice_of_this_thread() == seen["before"]  # the rest of the server keeps its priority


def test_zero_changes_nothing() -> None:
    before = nice_of_this_thread()
    done = threading.Thread(target=lambda: lower_priority(0))
    done.start()
    done.join()
    lower_priority(0)
    assert nice_of_this_thread() == before
