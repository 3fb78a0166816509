"""load_tests/placement/bench_placement.py on a small trace: every request runs exactly once, the tiers account for every
lookup, affinity keeps more of a skewed trace in the GPU tier than random placement, and a seed fixes the JSON."""

from __future__ import annotations

import json

import pytest

from load_tests.placement import bench_placement as bp
from load_tests.placement.skill_vectors import group_keys

REQUESTS, SKILLS = 2_000, 500


@pytest.fixture(scope="module")
def trace() -> bp.Trace:
    return bp.make_trace(REQUESTS, SKILLS, seed=3)


def test_the_trace_follows_the_mix_rules(trace: bp.Trace) -> None:
    assert len(trace.mixes) == len(trace.gaps) == len(trace.service) == REQUESTS
    sizes = [len(m) for m in trace.mixes]
    assert set(sizes) == {1, 2, 3}
    for mix in trace.mixes:
        assert len(set(mix)) == len(mix)
        assert all(0 <= s < SKILLS for s in mix)
        assert all(0 < abs(s - mix[0]) <= bp.NEIGHBOURS for s in mix[1:])
    firsts = [m[0] for m in trace.mixes]
    assert firsts.count(0) > firsts.count(SKILLS - 1)  # Zipf by rank: rank 0 is the most popular


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("policy", bp.POLICIES)
def test_every_request_runs_once_and_the_tiers_add_up(trace: bp.Trace, replicas: int, policy: str) -> None:
    res = bp.simulate(trace, replicas, policy, seed=3)
    assert res.dispatches == REQUESTS
    assert sorted(set(res.assigned)) == list(range(replicas))
    assert sum(res.served) == REQUESTS
    assert [res.assigned.count(i) for i in range(replicas)] == res.served
    assert res.lookups == sum(len(m) for m in trace.mixes)
    assert res.gpu_hits + res.host_hits + res.fetches == res.lookups
    row = res.summary()
    assert row["gpu_hit"] + row["host_hit"] + res.fetches / res.lookups == pytest.approx(1.0, abs=1e-3)
    assert row["busiest_over_mean"] >= 1.0


def test_a_full_house_queues_and_still_serves_everything(trace: bp.Trace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bp, "LOAD", 3.0)  # arrivals at three times the capacity: most requests wait
    res = bp.simulate(trace, 2, "affinity", seed=3)
    assert res.queued > REQUESTS // 2
    assert res.dispatches == REQUESTS and -1 not in res.assigned


def test_affinity_keeps_more_in_the_gpu_tier_than_random(trace: bp.Trace) -> None:
    for replicas in (2, 4):
        rnd = bp.simulate(trace, replicas, "random", seed=3).summary()
        aff = bp.simulate(trace, replicas, "affinity", seed=3).summary()
        assert aff["gpu_hit"] > rnd["gpu_hit"]
        assert aff["key_gpu_hit"] > rnd["key_gpu_hit"]


def test_the_segmented_gpu_tier_keeps_more_than_plain_lru_and_fetches_alike(trace: bp.Trace) -> None:
    for policy in ("random", "affinity"):
        slru, lru = (bp.simulate(trace, 4, policy, seed=3, gpu_tier=tier) for tier in ("slru", "lru"))
        assert slru.gpu_hits > lru.gpu_hits
        assert abs(slru.fetches - lru.fetches) <= 0.02 * lru.fetches  # the host tier decides fetches
    with pytest.raises(SystemExit, match="GPU tier"):
        bp.Simulation(trace, 4, "random", seed=3, gpu_tier="fifo")


def test_group_keys_are_the_servers_groups_and_partition_keeps_a_skill_home(trace: bp.Trace) -> None:
    keys = group_keys(SKILLS, 16)
    group = bp.Simulation(trace, 4, "group", seed=3, groups=keys)
    assert tuple(group.key(s) for s in range(SKILLS)) == keys and max(keys) < 0  # a group's key is no skill's id
    assert len(set(keys)) == -(-SKILLS // 16)  # one group per 16 skills
    same = sum(keys[s] == keys[s + 1] for s in range(SKILLS - 1)) / (SKILLS - 1)
    assert same > 0.7  # neighbours by rank mostly share a group
    with pytest.raises(ValueError, match="group_keys"):
        bp.Simulation(trace, 4, "group", seed=3)
    res = bp.simulate(trace, 4, "partition", seed=3)
    top = [res.assigned[i] for i, m in enumerate(trace.mixes) if m[0] == 0]
    # rank 0 has a home replica, left only when that replica is full
    assert max(top.count(r) for r in range(4)) > len(top) // 2


def test_same_seed_same_json_and_the_last_line_is_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--requests", str(REQUESTS), "--skills", str(SKILLS), "--replicas", "2,4", "--seed", "5"]
    lines = []
    for _ in range(2):
        assert bp.main(argv) == 0
        lines.append(capsys.readouterr().out.strip().splitlines())
    assert lines[0][-1] == lines[1][-1]
    doc = json.loads(lines[0][-1])
    assert set(doc) == {"N"} and set(doc["N"]) == {"2", "4"}
    for rows in doc["N"].values():
        assert set(rows) == set(bp.POLICIES)
        for row in rows.values():
            assert set(row) == {"gpu_hit", "store_fetch_rate", "busiest_over_mean"}
            assert all(isinstance(v, float) for v in row.values())
    assert any(line.startswith("| affinity |") for line in lines[0])
    assert bp.main([*argv[:-1], "6"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] != lines[0][-1]
