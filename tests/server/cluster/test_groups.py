"""Neighbourhoods of related skills as placement keys: the same groups whatever order skills arrive in, about one
leader per group-size skills, near skills together, local moves when the pool changes, skills without keys on
their own key, and the ingress's routing key using them (read from real store versions)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from skillpool.adapters_store.store import SkillStore
from skillpool.server.cluster.groups import PREFIX, SkillGroups, unit_vector
from skillpool.server.cluster.remote_engine import routing_key
from skillpool.server.cluster.replica import parse_key
from skillpool.server.engines import Mix
from tests.synthetic import curve_skills
from tests.synthetic import directions as skill_directions

N = 120


@pytest.fixture(scope="module")
def directions() -> np.ndarray:
    return skill_directions(N)


def filled(size: int, directions: np.ndarray, order: list[int]) -> SkillGroups:
    groups = SkillGroups(size)
    for i in order:
        groups.add(f"skill-{i:04d}", directions[i : i + 1])
    return groups


def keys(groups: SkillGroups) -> dict[str, str | None]:
    return {f"skill-{i:04d}": groups.key(f"skill-{i:04d}") for i in range(N)}


def test_groups_depend_on_the_pool_not_on_the_order_it_arrived_in(directions: np.ndarray) -> None:
    order = list(range(N))
    shuffled = order[:]
    random.Random(1).shuffle(shuffled)
    a, b = filled(8, directions, order), filled(8, directions, shuffled)
    assert keys(a) == keys(b)
    assert len(a.groups()) == math.ceil(N / 8)
    assert all(k is not None and k.startswith(PREFIX) for k in keys(a).values())


def test_near_skills_share_a_group_and_far_ones_do_not(directions: np.ndarray) -> None:
    groups = filled(8, directions, list(range(N)))
    members = groups.groups()
    for leader, names in members.items():
        assert leader in names  # a leader is its own nearest leader
    ranks = {name: int(name.split("-")[1]) for name in keys(groups)}
    same = [groups.key(f"skill-{i:04d}") == groups.key(f"skill-{i + 1:04d}") for i in range(N - 1)]
    far = [groups.key(f"skill-{i:04d}") == groups.key(f"skill-{(i + 50) % N:04d}") for i in range(N)]
    assert sum(same) / len(same) > 0.7  # the next rank is near: mostly the same group
    assert sum(far) / len(far) < 0.1  # fifty ranks on is not
    assert all(max(ranks[n] for n in names) - min(ranks[n] for n in names) < N // 2 for names in members.values())


def test_a_new_skill_moves_few_others_and_removal_reassigns_members(directions: np.ndarray) -> None:
    groups = filled(8, directions, list(range(N - 1)))
    before = {n: k for n, k in keys(groups).items() if k is not None}
    groups.add(f"skill-{N - 1:04d}", directions[N - 1 :])
    after = keys(groups)
    moved = [n for n in before if after[n] != before[n]]
    assert len(moved) <= 16  # at most the new leader's cell, or a leader promoted by the larger pool
    leader = next(iter(groups.groups()))
    groups.remove(leader)
    assert groups.key(leader) is None
    assert all(k != PREFIX + leader for k in keys(groups).values())
    assert len(groups) == N - 1


def test_skills_without_a_direction_keep_their_own_key(directions: np.ndarray) -> None:
    groups = filled(4, directions, [0, 1, 2])
    assert unit_vector(np.zeros((2, 8))) is None and unit_vector(np.full((1, 8), np.nan)) is None
    assert unit_vector(np.empty((0, 8))) is None
    assert not groups.add("skill-0001", np.full((1, 32), np.inf))  # a bad vector takes it out of its group
    assert groups.key("skill-0001") is None and groups.key("skill-0000") is not None
    versions = {"skill-0000": 2, "skill-0001": 5}
    assert routing_key(Mix.of({"skill-0001": 0.7, "skill-0000": 0.3}), versions, groups) == "skill-0001#v5"
    assert routing_key(Mix.of({"skill-0000": 1.0}), versions, groups) == groups.key("skill-0000")
    assert routing_key(Mix.of({"cand@candidate-1": 1.0}), versions, groups) == "cand@candidate-1#inline"
    assert routing_key(Mix.base(), versions, groups) is None
    with pytest.raises(ValueError, match="at least one"):
        SkillGroups(0)


def test_one_skill_a_group_is_every_skill_leading_itself(directions: np.ndarray) -> None:
    groups = filled(1, directions, list(range(10)))
    assert all(groups.key(f"skill-{i:04d}") == f"{PREFIX}skill-{i:04d}" for i in range(10))


def test_stored_versions_are_placed_by_their_router_keys(tmp_path: Path) -> None:
    curve_skills(tmp_path, 60)
    store = SkillStore(tmp_path)
    groups = SkillGroups(8)
    for rec in store.list_latest():
        assert groups.add_record(rec)
    assert len(groups.groups()) == math.ceil(60 / 8)
    key = groups.key("skill-0007")
    assert key is not None and parse_key(key) is None  # a replica preloads no skill for a group key
    rec = next(r for r in store.list_latest() if r.name == "skill-0007")
    (rec.path / "router.safetensors").unlink()  # a version whose router keys cannot be read: its own key
    assert not groups.add_record(rec)
    assert groups.key("skill-0007") is None and len(groups) == 59
