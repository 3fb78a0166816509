"""A process' memory as /proc reports it, for the benchmarks that measure it."""

from __future__ import annotations

from pathlib import Path


def status_kib(pid: int, field: str) -> int:
    """A kB field of /proc/PID/status: VmRSS (resident now), VmHWM (the most it has held)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_mib(pid: int) -> float:
    return status_kib(pid, "VmRSS") / 1024
