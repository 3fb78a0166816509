"""Skill lifecycle in the store: retire keeps every version, rollback pins one, a new version serves again; a
version whose record cannot be read is skipped with a warning, and the others serve and roll back as before."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillpool.adapters_store.store import SkillStore, UnreadableVersion
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


# a meta.json cut short by a full disk or a bad copy, emptied, not JSON text at all, or JSON that is no record
DAMAGE = [lambda raw: raw[: len(raw) // 2], lambda raw: b"", lambda raw: b"\xff\xfe" + raw, lambda raw: b"[1, 2]"]


@given(
    count=st.integers(1, 4),
    damaged=st.sets(st.integers(1, 4)),
    how=st.lists(st.sampled_from(range(len(DAMAGE))), min_size=4, max_size=4),
    pinned=st.one_of(st.none(), st.integers(1, 4)),
)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_version_whose_record_cannot_be_read_is_skipped_and_the_others_stay_manageable(
    tmp_path_factory, count: int, damaged: set[int], how: list[int], pinned: int | None
) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("damaged")
    store = SkillStore(root)
    for _ in range(count):
        store.write(draft("agnews"))
    store.write(draft("sst-2"))  # another skill, untouched
    pinned = pinned if pinned is not None and pinned <= count else None
    if pinned is not None:
        store.activate("agnews", pinned)
    damaged = {v for v in damaged if v <= count}
    for v in damaged:
        meta = root / "skills" / "agnews" / f"v{v}" / "meta.json"
        meta.write_bytes(DAMAGE[how[v - 1]](meta.read_bytes()))
    readable = [v for v in range(1, count + 1) if v not in damaged]

    again = SkillStore(root)  # a restart
    again.clean_tmp()
    want = pinned if pinned in readable else (readable[-1] if readable else None)
    served = {r.name: r.version for r in again.list_latest()}
    assert served == ({"agnews": want, "sst-2": 1} if want else {"sst-2": 1})
    assert [r.version for r in again.versions("agnews")] == readable
    assert (again.get("agnews").version if readable else None) == (readable[-1] if readable else None)  # type: ignore[union-attr]
    for v in range(1, count + 1):  # a rollback to each version: the readable ones serve, the others refuse
        if v in damaged:
            with pytest.raises(UnreadableVersion):
                again.activate("agnews", v)
        else:
            assert again.activate("agnews", v).version == v and again.serving("agnews").version == v  # type: ignore[union-attr]
    for v in damaged:  # still stored: a mended record serves again
        assert (root / "skills" / "agnews" / f"v{v}" / "meta.json").exists()


def test_a_damaged_record_is_warned_of_once_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = SkillStore(tmp_path)
    for _ in range(2):
        store.write(draft("agnews"))
    (tmp_path / "skills" / "agnews" / "v1" / "meta.json").write_text('{"name": "agn')  # an older version: never read
    again = SkillStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="skillpool.adapters_store.store"):
        again.clean_tmp()
        again.list_latest()
        again.versions("agnews")
    warned = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(warned) == 1 and "skills/agnews/v1" in warned[0] and "meta.json" in warned[0], warned
