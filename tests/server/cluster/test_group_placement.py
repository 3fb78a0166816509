"""Keys by neighbourhood through a real local Ray Serve (the engine deployment with the placement benchmark's
stand-in engine on 2 replicas): requests whose heaviest skills share a group land on the one replica holding that
group's key, a mix's other skills are then read there and nowhere else, and another group goes to the other
replica."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray", reason="the cluster extra: pip install -e .[cluster]")

import ray  # noqa: E402

from skillpool.runtime.base_model import resolve_base_model  # noqa: E402
from tests.conftest import until  # noqa: E402
from tests.server.cluster.ray_deployment import Deployment, one  # noqa: E402
from tests.synthetic import curve_skills  # noqa: E402

pytestmark = pytest.mark.slow
SKILLS, SIZE = 48, 8


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    data = tmp_path_factory.mktemp("store")
    curve_skills(data, SKILLS)
    args = argparse.Namespace(
        gpu_slots=4,
        host_slots=16,
        gpu_tier="slru",
        per_token_s=0.01,
        max_ongoing=8,
        mux_slots=4,
        tokenizer=resolve_base_model().path,
    )
    ray.init(num_cpus=2, include_dashboard=False, namespace="skillpool")
    try:
        dep = Deployment(args, data, replicas=2, keyed=True, group_size=SIZE)
        yield dep
        dep.close()
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def served(dep: Deployment) -> dict[str, dict[str, int]]:
    """Requests per key on each replica since the test began (the replicas report every second)."""
    return {r: dict(v["served"]) for r, v in dep.replica_stats().items()}


def run(dep: Deployment, mixes: list[dict[str, float]]) -> list[Any]:
    """One request after another: a replica is never full, so Ray never spills a key to the other one."""

    async def each() -> list[Any]:
        return [await one(dep.engine, i, m, 2, 0.0) for i, m in enumerate(mixes)]

    return asyncio.run(each())


def known(dep: Deployment, key: str) -> bool:
    """Whether Ray Serve's router in this process has heard which replica loaded `key`: the replica reports its
    multiplexed model ids to the controller, which passes them on to every handle's router."""
    router = dep.engine.handle._router._asyncio_router.request_router
    return bool(router._multiplexed_model_id_to_replica_ids.get(key))


def holders(dep: Deployment, key: str, want: int) -> list[str]:
    deadline = time.monotonic() + 15
    while True:  # the hub adds up the replicas' reports
        got = {r: v.get(key, 0) for r, v in served(dep).items()}
        if sum(got.values()) >= want or time.monotonic() > deadline:
            return [r for r, n in got.items() if n]
        time.sleep(0.5)


def test_a_neighbourhood_lands_on_one_replica_and_another_on_the_other(deployment: Deployment) -> None:
    groups = deployment.engine.groups
    assert groups is not None and len(groups) == SKILLS
    members = sorted(groups.groups().items(), key=lambda kv: -len(kv[1]))
    (lead_a, group_a), (lead_b, group_b) = members[0], members[1]
    assert len(group_a) >= 2 and len(group_b) >= 2
    mixes = [{group_a[i % len(group_a)]: 0.6, group_a[(i + 1) % len(group_a)]: 0.4} for i in range(12)]
    outcomes = run(deployment, mixes[:1])  # the first loads the key; Ray's router learns who holds it
    holders(deployment, f"group:{lead_a}", 1)
    until(lambda: known(deployment, f"group:{lead_a}"))
    outcomes += run(deployment, mixes[1:])
    assert all(o.ok for o in outcomes), outcomes
    (home_a,) = holders(deployment, f"group:{lead_a}", len(mixes))  # one replica served the whole group
    outcomes = run(deployment, [{group_b[0]: 1.0}])
    holders(deployment, f"group:{lead_b}", 1)
    until(lambda: known(deployment, f"group:{lead_b}"))
    outcomes += run(deployment, [{name: 1.0} for name in group_b[1:] + group_b])
    assert all(o.ok for o in outcomes)
    (home_b,) = holders(deployment, f"group:{lead_b}", 2 * len(group_b))
    assert home_b != home_a  # Ray gives a new key to the replica holding fewer
    # the second run's skills were all fetched on one replica: each from the store once, then from its tiers
    tiers = [t for o in outcomes for t in o.tiers]
    assert tiers.count("store") == len(group_b)
