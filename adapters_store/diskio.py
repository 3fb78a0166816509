"""Writes under the data dir that leave nothing behind: owner-tagged temp names, atomic replace, start-up sweeps.

Every temp file or folder carries its owner's tag (host, pid and the process' start time), so a sweep at start
removes exactly the leftovers of processes that are gone (a kill mid-write, a full disk) and never the write in
flight of a live one: servers and workers may share one data dir. A tag from another host cannot be checked
here, so its entries go only once older than FOREIGN_MAX_AGE_S (a live owner's long-lived scratch folder is
touched while it works); untagged temp entries, written before tags existed, go at once.

A write that fails raises StorageError (an OSError whose text names no path): the API answers it with 507.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})  # the disk (or the owner's quota) is full
FOREIGN_MAX_AGE_S = 24 * 3600.0

_HOST = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()) or "host"
_TAG = re.compile(r"~(?P<host>[A-Za-z0-9.-]+)~(?P<pid>\d+)~(?P<start>\d+)~")
_STARTS: dict[int, int] = {}


class StorageError(OSError):
    """A write to the data dir failed (disk full, quota, read-only file system); the text names no path."""

    @property
    def full(self) -> bool:
        return self.errno in FULL_ERRNOS


def storage_error(e: OSError) -> StorageError:
    return e if isinstance(e, StorageError) else StorageError(e.errno or errno.EIO, e.strerror or type(e).__name__)


def _start_time(pid: int) -> int:
    """The process' start (clock ticks since boot; 0 where /proc does not say): with the pid, one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[19])


def owner_tag() -> str:
    """This process' tag, put into every temp name it makes."""
    pid = os.getpid()  # after a fork the child is another owner
    if pid not in _STARTS:
        _STARTS[pid] = _start_time(pid)
    return f"~{_HOST}~{pid}~{_STARTS[pid]}~"


def _owner_alive(host: str, pid: int, start: int) -> bool | None:
    """Whether the tagged owner still runs; None when it cannot be told (another host)."""
    if host != _HOST:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    return _start_time(pid) == start  # a reused pid is another process


def owner_gone(tagged: str, written_at: float) -> bool:
    """Whether the writer whose owner_tag() is in `tagged` is gone: a dead process on this host, or another host's
    entry older than FOREIGN_MAX_AGE_S (an object store's claim has no file to stat, so it carries its time)."""
    m = _TAG.search(tagged)
    if m is None:
        return True
    alive = _owner_alive(m["host"], int(m["pid"]), int(m["start"]))
    return not alive if alive is not None else time.time() - written_at > FOREIGN_MAX_AGE_S


def temp_path(path: Path) -> Path:
    """A temp name beside `path`, owned by this process (a leading dot: never matched as a record)."""
    return path.with_name(f".{path.name}{owner_tag()}{uuid.uuid4().hex[:8]}.tmp")


def make_temp_dir(folder: Path, prefix: str) -> Path:
    """A new empty folder in `folder`, owned by this process."""
    try:
        return Path(tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}", dir=folder))
    except OSError as e:
        raise storage_error(e) from e


def atomic_write(path: Path, data: bytes, fsync: bool = True) -> None:
    """Write `path` whole or not at all: temp file + rename. On failure the temp file is gone and StorageError
    is raised."""
    tmp = temp_path(path)
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            log.warning("could not remove temp file %s", tmp)
        if isinstance(e, OSError):
            raise storage_error(e) from e
        raise


def _is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def _stale(p: Path, everything: bool, now: float) -> bool:
    m = _TAG.search(p.name)
    if m is None:
        return everything or _is_temp_name(p.name)
    alive = _owner_alive(m["host"], int(m["pid"]), int(m["start"]))
    if alive is not None:
        return not alive
    try:
        return now - p.lstat().st_mtime > FOREIGN_MAX_AGE_S
    except OSError:
        return False  # gone meanwhile


def sweep(folder: Path, everything: bool = False) -> list[Path]:
    """Remove the temp entries in `folder` (not below it) whose owner is gone; `everything`: the folder holds only
    temp entries (the store's tmp/), so untagged entries of any name go too. Returns what was removed."""
    if not folder.is_dir():
        return []
    now, removed = time.time(), []
    for p in folder.iterdir():
        if not _stale(p, everything, now):
            continue
        try:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not remove leftover %s: %s", p, e)
            continue
        removed.append(p)
    if removed:
        log.info("removed %d leftover temp entries in %s", len(removed), folder)
    return removed
