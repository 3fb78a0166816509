"""The Redis key layout is shared by servers and workers of different versions: these exact names are the
contract (a renamed key would strand the jobs already queued under the old one)."""

from __future__ import annotations

import dataclasses

import pytest

from skillpool.trainer.keys import DEFAULT_PREFIX, RedisKeys


def test_per_job_and_per_skill_keys_sit_under_the_prefix() -> None:
    keys = RedisKeys("team-a")
    assert [keys.job("j1"), keys.data("j1"), keys.lease("j1"), keys.cancel("j1"), keys.skill("sql")] == [
        "team-a:job:j1",
        "team-a:data:j1",
        "team-a:lease:j1",
        "team-a:cancel:j1",
        "team-a:skill:sql",
    ]
    assert keys.lease("") == "team-a:lease:"  # the sweep's prefix of every lease


def test_the_single_keys_and_the_default_prefix() -> None:
    keys = RedisKeys()
    assert DEFAULT_PREFIX == "skillpool"
    assert (keys.jobs, keys.queue, keys.processing, keys.events) == (
        "skillpool:jobs",
        "skillpool:queue",
        "skillpool:processing",
        "skillpool:events",
    )


def test_the_prefix_is_the_only_field_and_is_frozen() -> None:
    keys = RedisKeys("a")
    assert [f.name for f in dataclasses.fields(RedisKeys)] == ["prefix"]
    assert keys == RedisKeys("a") and keys != RedisKeys("b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        keys.prefix = "b"  # type: ignore[misc]
