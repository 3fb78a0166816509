"""Where skill versions live: a small object interface (get, put, list, delete) with two implementations, a local
folder (here) and an S3-compatible bucket (s3.py), chosen by `--adapter-store`.

Keys are '/'-separated paths under the store's root (`skills/<name>/v<N>/meta.json`): the same layout in a folder
and in a bucket. A version is published whole or not at all: its marker (meta.json) comes last, and a version
without it is invisible. A folder gets that from one rename; a bucket from uploading every other object first,
under a claim object that keeps two writers off one version number (S3's conditional write, If-None-Match).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from pathlib import Path

from .diskio import atomic_write, owner_gone, owner_tag, storage_error, sweep, temp_path

log = logging.getLogger(__name__)

CLAIM = ".claim"  # a remote version's first object: its writer's owner tag and time, until its marker lands
TIERS = ("gpu", "host", "disk", "store")  # where an adapter lookup is answered, fastest first


class StoreUnavailable(RuntimeError):
    """The adapter store cannot be reached, or refused the credentials: what needs an object from it fails (the API
    answers 503), what does not goes on."""


class ObjectStore(ABC):
    """Objects under one root. Methods are thread-safe; a failure to reach the store raises StoreUnavailable."""

    url: str
    remote: bool = True  # its objects are read through the node's disk cache (disk_cache.py)

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The object, or None when there is none."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write the object whole: a reader sees the old one or the new one."""

    @abstractmethod
    def put_new(self, key: str, data: bytes) -> bool:
        """Create the object unless it exists; False when it does (another writer's)."""

    @abstractmethod
    def upload(self, key: str, path: Path) -> None:
        """Write a local file as the object."""

    @abstractmethod
    def download(self, key: str, dest: Path) -> None:
        """Write the object into the local file `dest`; FileNotFoundError when there is none."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object (none is no error)."""

    def check(self) -> None:
        """Raise StoreUnavailable, saying why, when the store cannot be used (at start-up)."""
        return None

    def folder(self, prefix: str) -> Path | None:
        """The local folder that holds the objects under `prefix`, or None: they are downloaded to be read."""
        return None

    def cache_name(self) -> str:
        """A folder name for this store's disk cache, apart from other stores' caches."""
        raise NotImplementedError

    def tidy(self, prefix: str) -> None:
        """Remove leftovers under `prefix` that no key shows (a folder's temp files and empty folders)."""
        return None

    def publish(self, prefix: str, folder: Path, marker: str) -> bool:
        """Store every file of `folder` under `prefix`, `marker` last; False, storing nothing, when `prefix` is
        another writer's. On failure nothing visible is left: the objects are removed unless the marker may have
        landed (then the version is complete), and a killed writer's are swept by `stale_claim` at a start."""
        claim = f"{prefix}/{CLAIM}"
        if not self.put_new(claim, json.dumps({"owner": owner_tag(), "time": time.time()}).encode()):
            return False
        sent = [claim]
        marker_sent = False
        try:
            for p in sorted(folder.iterdir()):
                if p.name != marker:
                    self.upload(f"{prefix}/{p.name}", p)
                    sent.append(f"{prefix}/{p.name}")
            marker_sent = True
            self.upload(f"{prefix}/{marker}", folder / marker)  # from here on the version is visible
        except BaseException:
            if not marker_sent or self._absent(f"{prefix}/{marker}"):
                for key in reversed(sent):
                    try:
                        self.delete(key)
                    except Exception as e:  # the store went away: the objects stay, invisible without a marker
                        log.warning("could not remove %s after a failed publish: %s", key, e)
                        break
            raise
        try:
            self.delete(claim)
        except Exception as e:  # harmless: a complete version's claim is ignored
            log.warning("could not remove %s: %s", claim, e)
        return True

    def _absent(self, key: str) -> bool:
        try:
            return self.get(key) is None
        except Exception:
            return False  # cannot tell: leave the objects (invisible, or a complete version)

    def stale_claim(self, prefix: str) -> bool:
        """Whether the unfinished version under `prefix` was left by a writer that is gone."""
        raw = self.get(f"{prefix}/{CLAIM}")
        if raw is None:
            return True  # no claim: nobody is writing it
        try:
            claim = json.loads(raw)
            return owner_gone(str(claim["owner"]), float(claim["time"]))
        except (ValueError, KeyError, TypeError):
            return True


class FileObjects(ObjectStore):
    """Objects as files under a local folder: the data dir's `skills/`, today's layout. A version is published by
    renaming its folder into place, so it appears whole, marker included."""

    remote = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"not a store key: {key!r}")
        return self.root / key

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise storage_error(e) from e
        atomic_write(path, data, fsync=False)

    def put_new(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(path)
        try:
            tmp.write_bytes(data)
            os.link(tmp, path)  # fails if the name exists: create-if-absent, whole
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def upload(self, key: str, path: Path) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(dest)
        try:
            shutil.copyfile(path, tmp)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def download(self, key: str, dest: Path) -> None:
        shutil.copyfile(self._path(key), dest)

    def list(self, prefix: str) -> list[str]:
        if prefix.endswith("/") or not prefix:  # a folder's keys
            top = self._path(prefix.rstrip("/") or ".")
            if not top.is_dir():
                return []
        else:
            top = self._path(prefix).parent
        keys = []
        for folder, dirs, files in os.walk(top):
            dirs.sort()
            rel = Path(folder).relative_to(self.root).as_posix()
            for f in sorted(files):
                key = f if rel == "." else f"{rel}/{f}"
                if key.startswith(prefix) and not (f.startswith(".") and f.endswith(".tmp")):
                    keys.append(key)
        return keys

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        for parent in path.parents:  # the version's folder, then the skill's, once empty
            if parent == self.root:
                break
            try:
                parent.rmdir()
            except OSError:
                break

    def folder(self, prefix: str) -> Path:
        return self._path(prefix)

    def tidy(self, prefix: str) -> None:
        """Temp files of writers that are gone, then empty folders (a kill between mkdir and rename)."""
        top = self._path(prefix.rstrip("/"))
        if not top.is_dir():
            return
        for folder, _, _ in sorted(os.walk(top), key=lambda w: -len(Path(w[0]).parts)):  # deepest first
            if Path(folder) == top:
                continue
            sweep(Path(folder))
            try:
                Path(folder).rmdir()  # only an empty folder: never a version another writer just renamed into it
            except OSError:
                pass
        sweep(top)

    def publish(self, prefix: str, folder: Path, marker: str) -> bool:
        if not (folder / marker).is_file():
            raise FileNotFoundError(f"no {marker} to publish")
        _fsync_files(folder)
        target = self._path(prefix)
        made = not target.parent.is_dir()
        for _ in range(100):  # a start-up sweep may take an empty skill folder between our mkdir and rename
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(folder, target)  # fails if another process (a worker) took this version
                return True
            except OSError:
                if target.parent.is_dir() and target.exists():
                    return False
                if target.parent.is_dir():
                    if made:
                        _remove_if_empty(target.parent)  # a new name's folder, made for this write only
                    raise
        raise OSError(f"could not create {target.parent}")


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def _fsync_files(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_file():
            with p.open("rb") as fh:
                os.fsync(fh.fileno())


class TierCounts:
    """Adapter lookups answered per tier and adapters loaded into a tier, for the metrics (server/metrics.py)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits: Counter[str] = Counter()
        self.loads: Counter[str] = Counter()

    def hit(self, tier: str) -> None:
        with self._lock:
            self.hits[tier] += 1

    def load(self, tier: str) -> None:
        with self._lock:
            self.loads[tier] += 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.hits), dict(self.loads)
