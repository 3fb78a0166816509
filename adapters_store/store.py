"""Skill records on disk: one folder per skill version, written atomically (temp folder + rename).

Layout under the data dir:
    skills/<name>/v<N>/adapter_config.json, adapter_model.safetensors   (plain PEFT LoRA)
                       router.safetensors                                (the router's tensors)
                       meta.json  replay.json  probe.json  pseudo.json
                 state.json                                              (lifecycle: retired, pinned version)
    tmp/                                                                 (in-progress writes, scratch)
Only safetensors and JSON are ever read back; names are validated slugs, never raw paths.
Retiring or rolling back never deletes a version: `state.json` says which one serves (the newest unless
pinned) and whether the skill is retired, so every server reading the shared store agrees after a restart.
Temp entries carry their owner's tag (adapters_store.diskio): clean_tmp at start removes those of processes that
are gone, and a skill folder a kill left empty, never the write in flight of a live server or worker.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .diskio import atomic_write, make_temp_dir, sweep
from .lora import PEFT_CONFIG, PEFT_WEIGHTS, LoRAAdapter, load_peft_adapter
from .names import validate_skill_name

log = logging.getLogger(__name__)

META = "meta.json"
ROUTER = "router.safetensors"
REPLAY = "replay.json"
PROBE = "probe.json"
PSEUDO = "pseudo.json"  # SAPT generator samples (trainer/pseudo.py); absent in older skills
STATE = "state.json"  # per skill, beside its versions: {"retired": bool, "pinned": int | None}
_VERSION = re.compile(r"^v(\d+)$")


@dataclass(frozen=True)
class SkillRecord:
    """One stored, complete skill version."""

    name: str
    version: int
    path: Path
    meta: dict[str, Any]

    def adapter(self) -> LoRAAdapter:
        return load_peft_adapter(self.path)

    def router_tensors(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.path / ROUTER))

    def replay(self) -> list[dict[str, Any]]:
        return _read_json_list(self.path / REPLAY)

    def probe(self) -> list[dict[str, Any]]:
        return _read_json_list(self.path / PROBE)

    def pseudo(self) -> list[dict[str, Any]] | list[str]:
        return _read_json_list(self.path / PSEUDO)


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
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.skills_dir = self.root / "skills"
        self.tmp_dir = self.root / "tmp"
        self.skills_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def clean_tmp(self) -> None:
        """Drop leftovers of writes and scratch folders whose owner is gone (never visible as skills), version
        folders without meta.json (a version appears whole, by rename, so such a folder is debris) and skill
        folders left empty. A live owner's entries stay: the data dir may be shared."""
        sweep(self.tmp_dir, everything=True)
        for d in self.skills_dir.iterdir():
            if not d.is_dir():
                continue
            sweep(d)  # state.json temp files
            for v in d.iterdir():
                if _VERSION.match(v.name) and v.is_dir() and not (v / META).is_file():
                    log.warning("removing %s: a version folder without %s", v, META)
                    shutil.rmtree(v, ignore_errors=True)
            _remove_if_empty(d)

    @contextmanager
    def scratch(self, prefix: str) -> Iterator[Path]:
        """A private folder under tmp/ for work in progress (a block before it is stored): on the data dir's
        disk, removed after use, and swept at start if its owner was killed."""
        folder = make_temp_dir(self.tmp_dir, prefix)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def state(self, name: str) -> dict[str, Any]:
        """The skill's lifecycle state: {"retired": bool, "pinned": version or None}."""
        path = self.skills_dir / validate_skill_name(name) / STATE
        raw = json.loads(path.read_text()) if path.is_file() else {}
        return {"retired": bool(raw.get("retired", False)), "pinned": raw.get("pinned")}

    def _set_state(self, name: str, retired: bool, pinned: int | None) -> None:
        folder = self.skills_dir / validate_skill_name(name)
        # atomic: a reader sees the old state or the new one
        atomic_write(folder / STATE, json.dumps({"retired": retired, "pinned": pinned}).encode(), fsync=False)

    def retire(self, name: str) -> SkillRecord:
        """Stop serving `name`; every version stays on disk for a rollback. KeyError if it has none."""
        rec = self.get(name)
        if rec is None:
            raise KeyError(name)
        with self._lock:
            self._set_state(name, True, self.state(name)["pinned"])
        return rec

    def activate(self, name: str, version: int | None = None) -> SkillRecord:
        """Serve `name` again (un-retire), at `version` (pinned) or, with None, at its newest version."""
        versions = self._versions(validate_skill_name(name))
        if not versions or (version is not None and version not in versions):
            raise KeyError(f"{name} v{version}" if version is not None else name)
        with self._lock:
            self._set_state(name, False, version)
        rec = self.get(name, version if version is not None else versions[-1])
        assert rec is not None
        return rec

    def versions(self, name: str) -> list[SkillRecord]:
        """Every complete version of `name`, oldest first (retired or not)."""
        return [r for v in self._versions(validate_skill_name(name)) if (r := self.get(name, v)) is not None]

    def serving(self, name: str) -> SkillRecord | None:
        """The version that serves: the pinned one, else the newest; None when retired or absent."""
        state = self.state(name)
        if state["retired"]:
            return None
        pinned = state["pinned"]
        return (self.get(name, int(pinned)) if pinned is not None else None) or self.get(name)

    def _versions(self, name: str) -> list[int]:
        d = self.skills_dir / name
        if not d.is_dir():
            return []
        return sorted(int(m.group(1)) for p in d.iterdir() if (m := _VERSION.match(p.name)) and (p / META).is_file())

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
            (self.skills_dir / name).mkdir(exist_ok=True)
            with self._lock:
                if (self.skills_dir / name / STATE).is_file():  # a new version serves (and revives) the skill
                    self._set_state(name, False, None)
                version = (self._versions(name) or [0])[-1] + 1
                while True:
                    meta = {**draft.meta, "name": name, "version": version, "created": time.time()}
                    (tmp / META).write_text(json.dumps(meta, indent=2))
                    _fsync_dir_files(tmp)
                    target = self.skills_dir / name / f"v{version}"
                    try:
                        os.rename(tmp, target)  # fails if another process (a worker) took this version
                        break
                    except OSError:
                        if not target.parent.is_dir():  # a start-up sweep took the folder while it was empty
                            target.parent.mkdir(exist_ok=True)
                        elif target.exists():
                            version += 1
                        else:
                            raise
            return SkillRecord(name=name, version=version, path=target, meta=meta)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_if_empty(self.skills_dir / name)  # a new name's folder, made for this write only
            raise

    def get(self, name: str, version: int | None = None) -> SkillRecord | None:
        validate_skill_name(name)
        versions = self._versions(name)
        if not versions:
            return None
        v = versions[-1] if version is None else version
        if v not in versions:
            return None
        path = self.skills_dir / name / f"v{v}"
        return SkillRecord(name=name, version=v, path=path, meta=json.loads((path / META).read_text()))

    def list_latest(self) -> list[SkillRecord]:
        """The serving version (newest unless pinned by a rollback) of every skill that is not retired, by name."""
        out = []
        for d in sorted(self.skills_dir.iterdir()):
            if not d.is_dir():
                continue
            try:
                rec = self.serving(d.name)
            except ValueError:
                log.warning("ignoring %s: not a valid skill folder name", d)
                continue
            if rec is not None:
                out.append(rec)
        return out


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()  # only an empty folder: never a version another writer just renamed into it
    except OSError:
        pass


def _fsync_dir_files(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_file():
            with p.open("rb") as fh:
                os.fsync(fh.fileno())
