"""Skill records on disk: one folder per skill version, written atomically (temp folder + rename).

Layout under the data dir:
    skills/<name>/v<N>/adapter_config.json, adapter_model.safetensors   (plain PEFT LoRA)
                       router.safetensors                                (the router's tensors; none: a skill
                                                                          only named requests reach)
                       meta.json  replay.json  probe.json  pseudo.json
                 state.json                                              (lifecycle: retired, pinned version)
    tmp/                                                                 (in-progress writes, scratch, and
                                                                          files staged for a job: stage())
Only safetensors and JSON are ever read back; names are validated slugs, never raw paths.
Retiring or rolling back never deletes a version: `state.json` says which one serves (the newest unless
pinned) and whether the skill is retired, so every server reading the shared store agrees after a restart.
Temp entries carry their owner's tag (adapters_store.diskio): clean_tmp at start removes those of processes that
are gone, and a skill folder a kill left empty, never the write in flight of a live server or worker.

The skills may instead live in an object store (`--adapter-store s3://BUCKET/PREFIX`, objects.py and s3.py) under
the same keys (skills/<name>/v<N>/...): a version is published by uploading meta.json last, so one without it is
invisible, and its files are read through the node's disk cache (disk_cache.py) under the data dir's cache/.
tmp/ (writes in progress, the trainer's scratch) stays on the data dir's disk either way.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import torch
from safetensors.torch import load_file, save_file

from skillpool.lora.adapter import PEFT_CONFIG, PEFT_WEIGHTS, LoRAAdapter, load_peft_adapter

from .disk_cache import DEFAULT_CACHE_BYTES, DiskCache
from .diskio import make_temp_dir, storage_error, sweep
from .names import validate_skill_name
from .objects import CLAIM, FileObjects, ObjectStore, StoreUnavailable, TierCounts

log = logging.getLogger(__name__)

META = "meta.json"
ROUTER = "router.safetensors"
REPLAY = "replay.json"
PROBE = "probe.json"
PSEUDO = "pseudo.json"  # SAPT generator samples (trainer/pseudo.py); absent in older skills
STATE = "state.json"  # per skill, beside its versions: {"retired": bool, "pinned": int | None}
STAGED = "staged-"  # tmp/ folders of files kept for a job that has yet to run (SkillStore.stage)
_STAGE_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_VERSION = re.compile(r"^v(\d+)$")
_ADAPTER = (PEFT_CONFIG, PEFT_WEIGHTS)
T = TypeVar("T")
__all__ = [
    "DEFAULT_CACHE_BYTES",
    "SkillDraft",
    "SkillRecord",
    "SkillStore",
    "StoreUnavailable",
    "UnreadableVersion",
    "open_store",
]


class UnreadableVersion(LookupError):
    """A version whose record (meta.json) cannot be read: it is skipped, never served, and cannot be rolled back to."""


@dataclass(frozen=True)
class VersionFiles:
    """How a version's files are read: from the store's own folder, or through the node's disk cache. Adapter reads
    are lookups, counted by the tier that answered them (the disk cache, or the store) for the metrics."""

    prefix: str  # skills/<name>/v<N>
    objects: ObjectStore
    cache: DiskCache | None
    tiers: TierCounts

    def read(self, names: Sequence[str], read: Callable[[Path], T], lookup: bool = False) -> T:
        if self.cache is None:
            value = read(self.objects.folder(self.prefix) or Path(self.prefix))
            if lookup:
                self.tiers.hit("store")
            return value
        keys = [f"{self.prefix}/{n}" for n in names]
        for attempt in range(2):
            try:
                with self.cache.hold(keys, self.objects.download) as held:
                    value = read(held.root / self.prefix)
                break
            except FileNotFoundError:  # once more: another process on the node may have evicted it meanwhile
                if attempt:
                    raise
        if lookup:
            self.tiers.hit("store" if held.downloaded or held.fresh else "disk")
            if held.downloaded:
                self.tiers.load("disk")
        return value

    def warm(self, names: Sequence[str]) -> None:
        """Download what is not on the node yet; the lookup that reads it next counts it as a store fetch."""
        if self.cache is not None:
            with self.cache.hold([f"{self.prefix}/{n}" for n in names], self.objects.download, warm=True) as held:
                pass
            if held.downloaded:
                self.tiers.load("disk")


@dataclass(frozen=True)
class SkillRecord:
    """One stored, complete skill version."""

    name: str
    version: int
    path: Path  # the version's folder on this node: the store's own, or (a remote store) in the disk cache
    meta: dict[str, Any]
    files: VersionFiles | None = field(default=None, compare=False, repr=False)  # None: every file is in `path`

    def adapter(self) -> LoRAAdapter:
        return self._read(_ADAPTER, load_peft_adapter, lookup=True)

    def adapter_files(self) -> dict[str, bytes]:
        """The version's PEFT files as stored, by file name (an export, or a new version that keeps the adapter)."""
        return self._read(_ADAPTER, lambda d: {n: (d / n).read_bytes() for n in _ADAPTER})

    def fetch_adapter(self) -> None:
        """Bring the adapter's files onto this node now (a remote store's disk cache; nothing for a folder), so
        the engine reads them from local disk; StoreUnavailable when the store cannot be reached."""
        if self.files is not None:
            self.files.warm(_ADAPTER)

    def router_tensors(self) -> dict[str, torch.Tensor]:
        return self._read((ROUTER,), lambda d: load_file(str(d / ROUTER)))

    def replay(self) -> list[dict[str, Any]]:
        return self._json_list(REPLAY)

    def probe(self) -> list[dict[str, Any]]:
        return self._json_list(PROBE)

    def pseudo(self) -> list[dict[str, Any]] | list[str]:
        return self._json_list(PSEUDO)

    def _read(self, names: Sequence[str], read: Callable[[Path], T], lookup: bool = False) -> T:
        return read(self.path) if self.files is None else self.files.read(names, read, lookup)

    def _json_list(self, name: str) -> list[dict[str, Any]]:
        try:
            return self._read((name,), lambda d: _read_json_list(d / name))
        except FileNotFoundError:  # a remote version without it: older skills have no pseudo.json
            return []


def _read_json_list(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else []


@dataclass
class SkillDraft:
    """What a finished training job hands the store. `write_adapter` saves PEFT files into a folder."""

    name: str
    write_adapter: Callable[[Path], None]
    router_tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    replay: list[dict[str, Any]]
    probe: list[dict[str, Any]]
    pseudo: list[dict[str, Any]] | list[str] = field(default_factory=list)  # SAPT pseudo replay inputs


class SkillStore:
    def __init__(
        self, root: str | os.PathLike[str], objects: ObjectStore | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        """`root`: the data dir, holding tmp/ and the skills themselves, unless `objects` is a remote store (then
        its disk cache goes under root/cache/). StoreUnavailable: that store cannot be used."""
        self.root = Path(root)
        self.skills_dir = self.root / "skills"
        self.tmp_dir = self.root / "tmp"
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        if objects is None:
            self.skills_dir.mkdir(parents=True, exist_ok=True)
        self.objects = objects if objects is not None else FileObjects(self.root)
        self.objects.check()
        self.cache = (
            DiskCache(self.root / "cache" / "adapter-store" / self.objects.cache_name(), cache_bytes)
            if self.objects.remote
            else None
        )
        self.tiers = TierCounts()
        self._meta: dict[tuple[str, int], dict[str, Any]] = {}  # a remote version's meta.json: it never changes
        self._unreadable: set[tuple[str, int]] = set()  # versions whose meta.json was found damaged (warned once)
        self._lock = threading.Lock()

    @property
    def remote(self) -> bool:
        """Whether skills are downloaded to be read (an object store), not read in place (a folder)."""
        return self.objects.remote

    @property
    def location(self) -> str:
        return self.objects.url

    def clean_tmp(self) -> None:
        """Drop leftovers of writes and scratch folders whose owner is gone (never visible as skills), versions
        without meta.json whose writer is gone (a folder's appear whole, by rename, so one without it is debris; an
        object store's are claimed while they upload) and skill folders left empty. A live owner's entries stay: the
        data dir and the store may be shared. A version whose meta.json cannot be read is left alone, with a warning
        (it is skipped until its record is mended)."""
        sweep(self.tmp_dir, everything=True)
        for name, versions in sorted(_tree(self.objects.list("skills/")).items()):
            for version, files in sorted(versions.items()):
                prefix = _prefix(name, version)
                if META in files:
                    self._record(name, version)  # warns if it cannot be read
                    continue
                if CLAIM in files and not self.objects.stale_claim(prefix):
                    continue
                log.warning("removing %s: a version without %s", prefix, META)
                for f in sorted(files, key=lambda f: f == CLAIM):  # the claim last: it says what is unfinished
                    self.objects.delete(f"{prefix}/{f}")
        self.objects.tidy("skills/")

    @contextmanager
    def scratch(self, prefix: str) -> Iterator[Path]:
        """A private folder under tmp/ for work in progress (a block before it is stored): on the data dir's
        disk, removed after use, and swept at start if its owner was killed."""
        folder = make_temp_dir(self.tmp_dir, prefix)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def stage(self, key: str, write: Callable[[Path], None]) -> None:
        """Keep files for a job that has yet to run (an imported adapter, checked at intake) under tmp/, by the job's
        `key`: owned by this process, so what a server that died had staged is swept at the next start. A write that
        fails leaves nothing (StorageError for a full disk)."""
        folder = make_temp_dir(self.tmp_dir, f"{STAGED}{_stage_key(key)}-")
        try:
            write(folder)
        except BaseException as e:
            shutil.rmtree(folder, ignore_errors=True)
            if isinstance(e, OSError):
                raise storage_error(e) from e
            raise

    def staged(self, key: str) -> Path | None:
        """The folder `stage` wrote for `key`; None when there is none (used, or swept)."""
        found = sorted(self.tmp_dir.glob(f"{STAGED}{_stage_key(key)}-~*"))
        return found[0] if found else None

    def unstage(self, key: str) -> None:
        for folder in self.tmp_dir.glob(f"{STAGED}{_stage_key(key)}-~*"):
            shutil.rmtree(folder, ignore_errors=True)

    def state(self, name: str) -> dict[str, Any]:
        """The skill's lifecycle state: {"retired": bool, "pinned": version or None}."""
        raw_bytes = self.objects.get(f"skills/{validate_skill_name(name)}/{STATE}")
        raw = json.loads(raw_bytes) if raw_bytes is not None else {}
        return {"retired": bool(raw.get("retired", False)), "pinned": raw.get("pinned")}

    def _set_state(self, name: str, retired: bool, pinned: int | None) -> None:
        # whole: a reader sees the old state or the new one
        self.objects.put(
            f"skills/{validate_skill_name(name)}/{STATE}", json.dumps({"retired": retired, "pinned": pinned}).encode()
        )

    def retire(self, name: str) -> SkillRecord:
        """Stop serving `name`; every version stays in the store for a rollback. KeyError if it has none."""
        rec = self.get(name)
        if rec is None:
            raise KeyError(name)
        with self._lock:
            self._set_state(name, True, self.state(name)["pinned"])
        return rec

    def activate(self, name: str, version: int | None = None) -> SkillRecord:
        """Serve `name` again (un-retire), at `version` (pinned) or, with None, at its newest readable version.
        KeyError: no such version; UnreadableVersion: its record cannot be read (nothing changes)."""
        versions = self._versions(validate_skill_name(name))
        if not versions or (version is not None and version not in versions):
            raise KeyError(f"{name} v{version}" if version is not None else name)
        rec = self._newest(name, versions) if version is None else self._record(name, version)
        if rec is None:
            what = f"version {version}" if version is not None else "every version"
            raise UnreadableVersion(f"{what} of {name!r} has a {META} that cannot be read")
        with self._lock:
            self._set_state(name, False, version)
        return rec

    def versions(self, name: str) -> list[SkillRecord]:
        """Every complete version of `name`, oldest first (retired or not)."""
        return [r for v in self._versions(validate_skill_name(name)) if (r := self._record(name, v)) is not None]

    def serving(self, name: str) -> SkillRecord | None:
        """The version that serves: the pinned one, else the newest; None when retired or absent."""
        return self._serving(name, self._versions(validate_skill_name(name)), self.state(name))

    def _serving(self, name: str, versions: list[int], state: dict[str, Any]) -> SkillRecord | None:
        if state["retired"] or not versions:
            return None
        pinned = state["pinned"]
        return (self._record(name, int(pinned)) if pinned in versions else None) or self._newest(name, versions)

    def _newest(self, name: str, versions: list[int]) -> SkillRecord | None:
        """The newest of these versions whose record can be read."""
        return next((rec for v in reversed(versions) if (rec := self._record(name, v)) is not None), None)

    def _versions(self, name: str) -> list[int]:
        """The complete versions (those with their marker, meta.json), oldest first."""
        return sorted(
            v for v, files in _tree(self.objects.list(f"skills/{name}/")).get(name, {}).items() if META in files
        )

    def write(self, draft: SkillDraft) -> SkillRecord:
        """Write a new version of `draft.name`; it becomes visible only once complete."""
        name = validate_skill_name(draft.name)
        tmp = make_temp_dir(self.tmp_dir, f"{name}-")
        try:
            draft.write_adapter(tmp)
            for required in (PEFT_CONFIG, PEFT_WEIGHTS):
                if not (tmp / required).is_file():
                    raise FileNotFoundError(f"adapter writer produced no {required}")
            save_file({k: v.contiguous() for k, v in draft.router_tensors.items()}, str(tmp / ROUTER))
            (tmp / REPLAY).write_text(json.dumps(draft.replay))
            (tmp / PROBE).write_text(json.dumps(draft.probe))
            (tmp / PSEUDO).write_text(json.dumps(draft.pseudo))
            with self._lock:
                if self.objects.get(f"skills/{name}/{STATE}") is not None:  # a new version serves (and revives) it
                    self._set_state(name, False, None)
            # past every version number in use, complete or not: an unfinished one is another writer's. No lock
            # while it uploads: publish refuses a version another writer (thread or process) took first
            version = max(_tree(self.objects.list(f"skills/{name}/")).get(name, {0: set()})) + 1
            while True:
                meta = {**draft.meta, "name": name, "version": version, "created": time.time()}
                (tmp / META).write_text(json.dumps(meta, indent=2))
                if self.objects.publish(_prefix(name, version), tmp, META):
                    break
                version += 1  # another writer took this version
            rec = self._record(name, version, meta)
            assert rec is not None
            return rec
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a folder store renamed it into place; a bucket got copies

    def get(self, name: str, version: int | None = None) -> SkillRecord | None:
        validate_skill_name(name)
        versions = self._versions(name)
        if not versions:
            return None
        if version is None:
            return self._newest(name, versions)
        return self._record(name, version) if version in versions else None

    def _record(self, name: str, version: int, meta: dict[str, Any] | None = None) -> SkillRecord | None:
        prefix = _prefix(name, version)
        meta = meta or self._meta.get((name, version))
        if meta is None:
            raw = self.objects.get(f"{prefix}/{META}")
            if raw is None:
                return None
            meta = self._parse_meta(name, version, raw)
            if meta is None:
                return None
        if self.cache is not None:
            self._meta[(name, version)] = meta
        folder = self.objects.folder(prefix) or (self.cache.root / prefix if self.cache is not None else Path(prefix))
        return SkillRecord(name, version, folder, meta, VersionFiles(prefix, self.objects, self.cache, self.tiers))

    def _parse_meta(self, name: str, version: int, raw: bytes) -> dict[str, Any] | None:
        """A version's record, or None when it cannot be read (truncated, not JSON, not an object): the version is
        skipped, with a warning the first time, as one without a record is."""
        try:
            meta = json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            meta, why = None, f"{type(e).__name__}: {e}"
        else:
            why = f"a JSON {type(meta).__name__}, not an object"
        if isinstance(meta, dict):
            self._unreadable.discard((name, version))
            return meta
        if (name, version) not in self._unreadable:
            self._unreadable.add((name, version))
            log.warning(
                "skipping %s in %s: its %s cannot be read (%s)", _prefix(name, version), self.location, META, why
            )
        return None

    def list_latest(self) -> list[SkillRecord]:
        """The serving version (newest unless pinned by a rollback) of every skill that is not retired, by name."""
        keys = self.objects.list("skills/")
        tree, with_state = _tree(keys), {k.split("/")[1] for k in keys if k.count("/") == 2 and k.endswith(f"/{STATE}")}
        out = []
        for name in sorted(tree.keys() | with_state):
            try:
                validate_skill_name(name)
            except ValueError:
                log.warning("ignoring skills/%s in %s: not a valid skill folder name", name, self.location)
                continue
            complete = sorted(v for v, files in tree.get(name, {}).items() if META in files)
            state = self.state(name) if name in with_state else {"retired": False, "pinned": None}
            if (rec := self._serving(name, complete, state)) is not None:
                out.append(rec)
        return out


def open_store(
    data_dir: str | os.PathLike[str], url: str | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES
) -> SkillStore:
    """The store `--adapter-store` names: a folder (a path or file://PATH; none: the data dir, today's layout) or an
    S3-compatible bucket, s3://BUCKET/PREFIX (boto3, the `cluster` extra). StoreUnavailable: it cannot be used."""
    if not url:
        return SkillStore(data_dir)
    parts = urlsplit(url)
    if parts.scheme == "" or (parts.scheme == "file" and parts.netloc in ("", "localhost")):
        return SkillStore(parts.path if parts.scheme else url)
    if parts.scheme == "s3":
        try:
            from .s3 import S3Objects
        except ImportError as e:
            raise ImportError(f"--adapter-store {url} needs boto3: pip install -e '.[cluster]' ({e})") from e
        return SkillStore(data_dir, S3Objects.from_url(url), cache_bytes)
    raise ValueError(f"--adapter-store {url!r}: a path, file://PATH or s3://BUCKET/PREFIX")


def _stage_key(key: str) -> str:
    if not _STAGE_KEY.match(key):
        raise ValueError(f"a staging key is 1-64 letters, digits, '_' or '-', got {key!r}")
    return key


def _prefix(name: str, version: int) -> str:
    return f"skills/{name}/v{version}"


def _tree(keys: Sequence[str]) -> dict[str, dict[int, set[str]]]:
    """name -> version -> the files stored under skills/<name>/v<version>/."""
    out: dict[str, dict[int, set[str]]] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "skills" and (m := _VERSION.match(parts[2])):
            out.setdefault(parts[1], {}).setdefault(int(m.group(1)), set()).add(parts[3])
    return out
