"""Skill lifecycle in the store: retire keeps every version, rollback pins one, a new version serves again."""

from __future__ import annotations

from pathlib import Path

import pytest

from skillpool.adapters_store.store import SkillStore
from tests.adapters_store.test_store import draft


def test_retire_hides_the_skill_and_keeps_its_versions(tmp_path: Path) -> None:
    store = SkillStore(tmp_path)
    store.write(draft("agnews"))
    store.write(draft("sst-2"))
    store.retire("agnews")
    assert [r.name for r in store.list_latest()] == ["sst-2"]
    assert store.serving("agnews") is None and [r.version for r in store.versions("agnews")] == [1]
    assert [r.name for r in SkillStore(tmp_path).list_latest()] == ["sst-2"]  # another server, after a restart
    with pytest.raises(KeyError):
        store.retire("nope")


def test_rollback_pins_an_earlier_version_until_a_new_one_is_trained(tmp_path: Path) -> None:
    store = SkillStore(tmp_path)
    for _ in range(3):
        store.write(draft("agnews"))
    assert store.serving("agnews").version == 3  # type: ignore[union-attr]
    store.retire("agnews")
    assert store.activate("agnews", 2).version == 2  # a retired skill comes back at the version asked for
    assert [(r.name, r.version) for r in SkillStore(tmp_path).list_latest()] == [("agnews", 2)]
    assert store.state("agnews") == {"retired": False, "pinned": 2}
    with pytest.raises(KeyError):
        store.activate("agnews", 9)
    assert store.write(draft("agnews")).version == 4  # retraining serves the new version, unpinned
    assert store.serving("agnews").version == 4 and store.state("agnews")["pinned"] is None  # type: ignore[union-attr]
    assert store.activate("agnews").version == 4  # no version: the newest
