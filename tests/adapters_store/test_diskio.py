"""Owner-tagged temp files: a failed write leaves nothing, and a start-up sweep removes exactly the leftovers of
processes that are gone (never a live writer's), in files/, jobs/, the store's tmp/ and skills/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from skillpool.adapters_store import diskio
from skillpool.adapters_store.diskio import StorageError, atomic_write, make_temp_dir, owner_tag, sweep, temp_path
from skillpool.adapters_store.store import SkillDraft, SkillStore
from tests.disk import fill, small_tmpfs


def _dead_tag() -> str:
    """The tag a process that has exited carried (same host, its pid and start time)."""
    out = subprocess.run(
        [sys.executable, "-c", "from skillpool.adapters_store.diskio import owner_tag; print(owner_tag())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_a_sweep_removes_dead_owners_leftovers_and_keeps_live_ones(tmp_path: Path) -> None:
    dead = _dead_tag()
    assert dead != owner_tag() and dead.split("~")[1] == owner_tag().split("~")[1]  # same host, another process
    mine = temp_path(tmp_path / "file-a.jsonl")
    mine.write_bytes(b"in flight")
    theirs = tmp_path / f".file-b.jsonl{dead}0123abcd.tmp"
    theirs.write_bytes(b"half")
    legacy = tmp_path / ".file-c.jsonl.89abcdef.tmp"  # written before tags: nobody can be writing it now
    legacy.write_bytes(b"half")
    record = tmp_path / "file-d.json"
    record.write_text("{}")
    far = tmp_path / ".file-e.jsonl~otherhost~12~34~aaaaaaaa.tmp"  # another host's: judged by its age
    far.write_bytes(b"?")
    old = tmp_path / ".file-f.jsonl~otherhost~12~34~bbbbbbbb.tmp"
    old.write_bytes(b"?")
    stale = time.time() - diskio.FOREIGN_MAX_AGE_S - 60
    os.utime(old, (stale, stale))

    removed = sweep(tmp_path)

    assert sorted(removed) == sorted([theirs, legacy, old])
    assert mine.exists() and record.exists() and far.exists()


def test_the_store_sweep_keeps_live_writes_and_removes_debris(tmp_path: Path) -> None:
    store = SkillStore(tmp_path)
    dead = _dead_tag()
    live = make_temp_dir(store.tmp_dir, "agnews-")  # this process is writing it
    (store.tmp_dir / f"sst-2-{dead}x1").mkdir()  # a killed writer's folder
    (store.skills_dir / "empty").mkdir()  # a kill between mkdir and rename
    (store.skills_dir / "half" / "v1").mkdir(parents=True)  # never completed: no meta.json
    (store.skills_dir / "agnews" / "v1").mkdir(parents=True)
    (store.skills_dir / "agnews" / "v1" / "meta.json").write_text(json.dumps({"name": "agnews", "version": 1}))
    (store.skills_dir / "agnews" / f".state.json{dead}00000000.tmp").write_text("{")

    store.clean_tmp()

    assert list(store.tmp_dir.iterdir()) == [live]
    assert sorted(p.name for p in store.skills_dir.iterdir()) == ["agnews"]
    assert [p.name for p in (store.skills_dir / "agnews").iterdir()] == ["v1"]


def _draft(name: str = "agnews", weights: int = 1_000) -> SkillDraft:
    def write(folder: Path) -> None:
        (folder / "adapter_config.json").write_text("{}")
        (folder / "adapter_model.safetensors").write_bytes(b"\0" * weights)

    return SkillDraft(name, write, {"k": torch.zeros(4)}, {}, [], [])


def test_writes_into_a_full_disk_fail_whole_and_leave_nothing(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        store = SkillStore(disk)
        ballast = fill(disk)
        with pytest.raises(StorageError) as err:
            atomic_write(disk / "record.json", b"{}" * 1000)
        assert err.value.full and str(disk) not in str(err.value)  # the text names no path
        with pytest.raises(OSError):
            store.write(_draft("new-skill"))
        assert sorted(p.name for p in disk.iterdir()) == [ballast.name, "skills", "tmp"]
        assert list(store.tmp_dir.iterdir()) == [] and list(store.skills_dir.iterdir()) == []
        ballast.unlink()
        assert store.write(_draft("new-skill")).version == 1
