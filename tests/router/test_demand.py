"""Fallback demand clusters: requests no skill serves, grouped online with bounded memory."""

from __future__ import annotations

import numpy as np
import pytest

from skillpool.router import Router, RouterSettings
from skillpool.router.demand import DemandSettings, FallbackClusters
from tests.datasets import read_task


def test_repeated_unseen_task_requests_form_one_cluster_each(embedder) -> None:  # type: ignore[no-untyped-def]
    router = Router(embedder, RouterSettings())
    ex = read_task("long_sequence", "agnews", "train", 100)
    router.add_skill(
        "agnews",
        router.prepare_keys([e["route_text"] for e in ex], [e["route_input"] for e in ex], [e["answer"] for e in ex]),
    )
    unseen = {t: [e["route_text"] for e in read_task("long_sequence", t, "test", 30)] for t in ("qqp", "imdb")}
    for i in range(0, 30, 10):  # interleaved batches, as traffic arrives
        for texts in unseen.values():
            ds = router.route_traffic(texts[i : i + 10])
            assert all(not d.route for d in ds)  # both tasks are unseen: they fall back
    assert router.demand.observed == 60
    clusters = router.demand.snapshot(router.nearest_skills)
    top = clusters[:2]
    assert sum(c["count"] for c in top) >= 54, [c["count"] for c in clusters]  # two clusters hold ~all of it
    for c in top:  # each is one task: its examples all come from the same task
        owners = {t for t, texts in unseen.items() for x in c["examples"] if x in [s[:300] for s in texts]}
        assert len(owners) == 1 and len(c["examples"]) == 3
        assert c["nearest_skills"][0]["skill"] == "agnews"  # the only skill, reported as the nearest
    routed = router.route_traffic([e["route_text"] for e in read_task("long_sequence", "agnews", "test", 10)])
    assert all(d.route for d in routed[:8]) and router.demand.observed == 60  # served requests are not demand


def test_memory_stays_bounded_and_old_demand_decays() -> None:
    now = [0.0]
    s = DemandSettings(max_clusters=5, examples=2, example_chars=20, half_life_s=10.0, similarity=0.9)
    demand = FallbackClusters(s, clock=lambda: now[0])
    rng = np.random.default_rng(0)
    for _ in range(50):  # 500 random directions: far apart, each would start a cluster
        x = rng.normal(size=(10, 32)).astype(np.float32)
        demand.add(x / np.linalg.norm(x, axis=1, keepdims=True), ["a very long prompt " * 5] * 10)
        now[0] += 1.0
    rows = demand.snapshot()
    assert len(demand) == 5 and len(rows) == 5 and demand.observed == 500
    assert all(len(r["examples"]) <= 2 and all(len(e) <= 20 for e in r["examples"]) for r in rows)
    one = np.eye(32, dtype=np.float32)[:1]
    for _ in range(8):
        demand.add(one, ["same"])
    assert demand.snapshot()[0]["count"] == 8 and demand.snapshot()[0]["size"] == pytest.approx(8.0)
    now[0] += 10.0  # one half-life later
    assert demand.snapshot()[0]["size"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="one embedding row per text"):
        demand.add(one, ["a", "b"])
