"""The node's disk cache of a remote adapter store: objects downloaded once, kept least-recently-used within a byte
bound (`--adapter-cache-bytes`).

One download per object however many threads want it at once (a lock per key: the first downloads, the others
wait and then find the file). Processes on one node may share the folder: a download goes to an owner-tagged temp
name and is renamed into place, so a reader sees a whole file or none, and a start sweeps the temp files of
processes that are gone. Each process keeps the files it knows of (its own downloads, and those it found) under the
bound; a file another process evicts between fetch and read is fetched again by the reader (store.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .diskio import storage_error, sweep, temp_path

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 2 * 2**30

Download = Callable[[str, Path], None]  # (key, local file): writes the object there; FileNotFoundError if none


@dataclass(frozen=True)
class Held:
    """Objects present on local disk while the `hold` block runs."""

    root: Path  # a key's file is root / key
    downloaded: bool  # at least one was downloaded by this hold
    fresh: bool  # a read found one that a warm-up downloaded and nothing read since


class DiskCache:
    def __init__(self, root: Path, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"the adapter cache size must be >= 0 bytes, not {max_bytes}")
        self.root, self.max_bytes = root, max_bytes
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise storage_error(e) from e
        self._mu = threading.Lock()  # the index, pins and per-key locks; never held across a download
        self._locks: dict[str, threading.Lock] = {}
        self._pins: Counter[str] = Counter()
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._fresh: set[str] = set()
        self.bytes = 0
        self.downloads = 0
        self._scan()

    def _scan(self) -> None:
        """Take over the files already here (a restart keeps its cache), oldest use first; sweep dead temp files."""
        found = []
        for folder, _, files in os.walk(self.root):
            removed = {p.name for p in sweep(Path(folder))}
            for f in files:
                if f in removed or (f.startswith(".") and f.endswith(".tmp")):
                    continue
                p = Path(folder) / f
                try:
                    st = p.stat()
                except OSError:
                    continue
                found.append((st.st_mtime, p.relative_to(self.root).as_posix(), st.st_size))
        with self._mu:
            for _, key, size in sorted(found):
                self._lru[key] = size
                self.bytes += size
            self._evict()

    def __contains__(self, key: str) -> bool:
        return (self.root / _checked(key)).is_file()

    @contextmanager
    def hold(self, keys: Sequence[str], download: Download, warm: bool = False) -> Iterator[Held]:
        """Every key's file on local disk (downloaded if absent), none evicted by this process until the block
        ends. `warm`: a warm-up ahead of a read, whose downloads the next read reports as `fresh`."""
        keys = [_checked(k) for k in keys]
        with self._mu:
            for k in keys:
                self._pins[k] += 1
        try:
            downloaded = fresh = False
            for k in keys:
                got = self._ensure(k, download)
                downloaded |= got
                with self._mu:
                    if got and warm:
                        self._fresh.add(k)
                    elif not warm and k in self._fresh:
                        self._fresh.discard(k)
                        fresh = True
            yield Held(self.root, downloaded, fresh)
        finally:
            with self._mu:
                for k in keys:
                    self._pins[k] -= 1
                    if self._pins[k] <= 0:
                        del self._pins[k]
                self._evict()

    def _key_lock(self, key: str) -> threading.Lock:
        with self._mu:
            return self._locks.setdefault(key, threading.Lock())

    def _ensure(self, key: str, download: Download) -> bool:
        """The key's file present; True when this call downloaded it."""
        path = self.root / key
        with self._key_lock(key):  # single flight: the others wait here, then find the file
            if path.is_file():
                self._touch(key, path)
                return False
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise storage_error(e) from e
            tmp = temp_path(path)
            try:
                download(key, tmp)
                os.replace(tmp, path)  # whole or not at all, for every process on the node
            except BaseException as e:
                tmp.unlink(missing_ok=True)
                if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
                    raise storage_error(e) from e
                raise
            size = path.stat().st_size
            with self._mu:
                self.bytes += size - self._lru.pop(key, 0)
                self._lru[key] = size
                self.downloads += 1
            return True

    def _touch(self, key: str, path: Path) -> None:
        with self._mu:
            if key in self._lru:
                self._lru.move_to_end(key)
            else:  # another process on the node downloaded it
                try:
                    size = path.stat().st_size
                except OSError:
                    return
                self._lru[key] = size
                self.bytes += size
        try:
            os.utime(path)  # the use, for the order a restart (or another process) takes over
        except OSError:
            pass

    def _evict(self) -> None:
        """Least recently used unpinned files go until the bound holds (called with _mu held)."""
        for key in list(self._lru):
            if self.bytes <= self.max_bytes:
                return
            if self._pins.get(key):
                continue
            self.bytes -= self._lru.pop(key)
            self._fresh.discard(key)
            try:
                (self.root / key).unlink(missing_ok=True)
            except OSError as e:
                log.warning("could not evict %s from the adapter cache: %s", key, e)

    def keys(self) -> list[str]:
        """The cached keys, least recently used first."""
        with self._mu:
            return list(self._lru)


def _checked(key: str) -> str:
    if not key or key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"not a cache key: {key!r}")
    return key
