"""Hand memory freed after a training job back to the OS.

A training step's activations are many short-lived tensors; glibc keeps the pages they used in its
arenas after they are freed, so a server that trained one long-sequence task kept that peak
footprint for good. So after every job (and every in-process baseline fit) we collect and trim once
(what it saves: docs/design/decisions.md, the heap trim).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
from collections.abc import Callable
from functools import cache

log = logging.getLogger(__name__)

ENV = (
    "SKILLPOOL_HEAP_TRIM"  # 0/false/off turns the trim off (for the measurement in load_tests/training/bench_memory.py)
)


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        fn = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    trim: Callable[[int], int] = fn
    return trim


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def release_freed_memory() -> bool:
    """Collect garbage and return the C heap's free pages to the OS; True when pages were released."""
    if not enabled():
        return False
    gc.collect()
    fn = _malloc_trim()
    if fn is None:
        return False
    released = bool(fn(0))
    log.debug("malloc_trim released memory: %s", released)
    return released
