"""The console's read-only endpoints (server.console_api) over the real app on a tiny LLaMA with the real router:
whoami per role, the routing share and fallbacks of real chat requests, window validation, the bounded ring,
probe accuracy with its history, and the confusion matrix of a trained skill's probes. The tests share one
server and run in file order: the first sees an empty pool, later ones the skill trained by the fixture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from skillpool.router import Decision
from skillpool.server.app import create_app
from skillpool.server.auth import KeyRing
from skillpool.server.routing_log import BUCKETS, RoutingLog
from tests.conftest import wait_job
from tests.datasets import dataset_dir, sst2_lines
from tests.server.test_api import assert_error, chat

DEFAULT_MAX_TOKENS = 2  # the conftest server's default answer length
FAST = json.dumps({"epochs": 1, "batch_size": 8, "max_seq_len": 256})  # a random tiny model learns nothing anyway
KEYS_FILE = "alice chat k-alice-0001\nbob train k-bob-00002\nroot admin k-root-00004\n"
BEARER = {"alice": "k-alice-0001", "bob": "k-bob-00002", "root": "k-root-00004", "unknown": "k-nobody-006"}
OFF_TOPIC = "Write a limerick about a penguin who learns to fly."


def auth(who: str) -> dict[str, str]:
    return {"authorization": f"Bearer {BEARER[who]}"}


def routing(client: TestClient, window: int = 3600, **kw: Any) -> dict[str, Any]:
    r = client.get("/v1/skillpool/routing", params={"window": window}, **kw)
    assert r.status_code == 200, r.text
    return dict(r.json())


def per_skill(report: dict[str, Any]) -> dict[str, int]:
    return {row["skill"]: row["requests"] for row in report["skills"]}


@pytest.fixture(scope="module")
def skill(client: TestClient) -> str:
    """sst-2, trained through the task API (forced: the random tiny model cannot pass the quality gate)."""
    data = {"name": "sst-2", "config": FAST, "force": "true"}
    r = client.post("/tasks", files={"file": ("sst2.jsonl", sst2_lines(40))}, data=data)
    assert r.status_code == 202, r.text
    assert wait_job(client, r.json()["id"])["status"] == "succeeded"
    return "sst-2"


def on_topic() -> str:
    """An sst-2 test prompt: the router sends it to the sst-2 skill."""
    line = (dataset_dir("long_sequence", "sst-2") / "test.jsonl").read_text(encoding="utf-8").split("\n")[0]
    row = json.loads(line)
    return f"{row['instruction']}\n{row['input']}"


def test_an_empty_pool_has_no_accuracy_and_a_base_only_confusion(client: TestClient) -> None:
    acc = client.get("/v1/skillpool/routing/accuracy").json()
    assert acc["skills"] == {} and acc["mean"] is None and acc["history"] == []
    assert acc["labelled"] is None  # no request has named the skill it expects
    assert client.get("/v1/skillpool/routing/confusion").json() == {
        "source": "probes",
        "labels": ["base"],
        "matrix": [[0]],
    }
    report = routing(client)
    assert report["skills"] == [] and report["requests"] == report["fallbacks"] == 0
    assert report["fallback_share"] == 0.0


@pytest.mark.parametrize("window", ["0", "59", "86401", "abc", "1e309", "", "-60", " 60", "60.0", "9" * 400])
def test_a_window_out_of_range_or_not_a_whole_number_is_a_400_naming_it(client: TestClient, window: str) -> None:
    err = assert_error(client.get("/v1/skillpool/routing", params={"window": window}), 400, "window", "invalid_value")
    assert "60" in err["message"] and "86400" in err["message"]


@pytest.mark.parametrize("window", [60, 61, 720, 721, 3600, 86400])
def test_a_window_has_twelve_aligned_buckets_oldest_first(client: TestClient, window: int) -> None:
    report = routing(client, window)
    assert report["window"] == window and len(report["buckets"]) == BUCKETS
    starts = [b["start"] for b in report["buckets"]]
    widths = [b - a for a, b in zip(starts, starts[1:])]
    assert all(w == pytest.approx(window / BUCKETS, abs=1e-2) for w in widths)
    assert sum(b["requests"] for b in report["buckets"]) == report["requests"]
    assert sum(b["fallbacks"] for b in report["buckets"]) == report["fallbacks"]


def test_the_default_window_is_an_hour(client: TestClient) -> None:
    assert client.get("/v1/skillpool/routing").json()["window"] == 3600


def test_routed_requests_count_by_skill_and_a_base_routed_one_as_a_fallback(client: TestClient, skill: str) -> None:
    before = routing(client)
    assert per_skill(before).get(skill) is not None  # a served skill is listed even before its first request
    routed = chat(client, on_topic())
    assert routed.status_code == 200 and routed.headers["x-skillpool-route"].startswith(f"{skill}="), routed.text
    fell_back = chat(client, OFF_TOPIC)
    assert fell_back.status_code == 200 and fell_back.headers["x-skillpool-route"] == "base", fell_back.text
    assert chat(client, "anything", model=skill).status_code == 200  # forced: not a routing decision
    assert chat(client, "anything", model="base").status_code == 200  # asked for: not a fallback
    after = routing(client)
    assert after["requests"] == before["requests"] + 2
    assert after["fallbacks"] == before["fallbacks"] + 1
    assert per_skill(after)[skill] == per_skill(before)[skill] + 1
    assert after["fallback_share"] == pytest.approx(after["fallbacks"] / after["requests"])
    shares = {row["skill"]: row["share"] for row in after["skills"]}
    assert shares[skill] == pytest.approx(per_skill(after)[skill] / after["requests"])
    assert sum(per_skill(after).values()) + after["fallbacks"] == after["requests"]
    assert sum(b["requests"] for b in after["buckets"]) == after["requests"]
    assert sum(b["requests"] for b in after["buckets"][-2:]) >= 2  # they came just now: the newest buckets
    short = routing(client, 60)  # counted to the second as well
    assert short["requests"] >= 2 and short["fallbacks"] >= 1


def test_the_ring_stays_bounded_and_forgets_what_is_older_than_a_day() -> None:
    log = RoutingLog()
    t0 = 1_700_000_000.0
    for i in range(3 * 86_400 // 7):  # three days, a request every 7 s, every fifth one a fallback
        log.record(Decision(route=[] if i % 5 == 0 else [("a", 0.7), ("b", 0.3)], reason="matched"), t0 + 7 * i)
    bound = log.slots()
    assert bound <= 2 * 86_400 // 60  # at most two slots per minute of a day, whatever the traffic
    now = t0 + 3 * 86_400
    day = log.window(86_400, now=now)
    in_day = [i for i in range(3 * 86_400 // 7) if t0 + 7 * i >= day["buckets"][0]["start"]]
    assert day["requests"] == len(in_day)
    assert day["fallbacks"] == sum(1 for i in in_day if i % 5 == 0)
    assert per_skill(day) == {"a": day["requests"] - day["fallbacks"]}  # the heaviest skill of each route
    for i in range(10_000):  # a day later still: as many slots as before, no more
        log.record(Decision(route=[("a", 1.0)], reason="matched"), now + 9 * i)
    assert log.slots() <= bound
    assert log.window(60, now=now + 9 * 9_999)["requests"] > 0


def test_a_request_lands_in_the_bucket_of_its_time() -> None:
    log = RoutingLog()
    now = 1_700_000_000.0
    for ago in (7200, 1000, 30):  # in the order they came; the first is outside the hour
        log.record(Decision(route=[("a", 1.0)], reason="matched"), now - ago)
    hour = log.window(3600, ["a", "b"], now=now)
    assert hour["requests"] == 2 and per_skill(hour) == {"a": 2, "b": 0}
    width = 3600 / BUCKETS
    for t in (now - 30, now - 1000):
        [b] = [b for b in hour["buckets"] if b["start"] <= t < b["start"] + width]
        assert b["requests"] == 1


def test_probe_accuracy_history_and_labelled_traffic(client: TestClient, components, skill: str) -> None:  # type: ignore[no-untyped-def]
    acc = client.get("/v1/skillpool/routing/accuracy").json()
    assert set(acc["skills"]) == {skill} and 0.0 <= acc["skills"][skill] <= 1.0
    assert acc["mean"] == pytest.approx(sum(acc["skills"].values()) / len(acc["skills"]))
    assert acc["history"][-1]["skills"] == acc["skills"] and acc["history"][-1]["mean"] == acc["mean"]
    assert all(isinstance(h["t"], float) for h in acc["history"])
    rolled = client.post(f"/v1/models/{skill}/rollback")  # the pool changes: routing is measured again
    assert rolled.status_code == 200, rolled.text
    again = client.get("/v1/skillpool/routing/accuracy").json()
    assert len(again["history"]) == len(acc["history"]) + 1 and again["history"][-1]["t"] >= acc["history"][-1]["t"]
    labelled_before = again["labelled"] or {"requests": 0, "correct": 0}
    route = chat(client, on_topic(), metadata={"expected_skill": skill}).json()["skillpool"]["route"]
    hit = bool(route) and route[0]["skill"] == skill
    chat(client, OFF_TOPIC, metadata={"expected_skill": skill})  # falls back: a wrong route for its label
    labelled = client.get("/v1/skillpool/routing/accuracy").json()["labelled"]
    assert labelled == {
        "requests": labelled_before["requests"] + 2,
        "correct": labelled_before["correct"] + int(hit),
    }


def test_the_confusion_rows_are_each_skills_probes(client: TestClient, components, skill: str) -> None:  # type: ignore[no-untyped-def]
    conf = client.get("/v1/skillpool/routing/confusion").json()
    names = [rec.name for rec in components.pool.records()]
    assert conf["source"] == "probes" and conf["labels"] == [*names, "base"]
    assert len(conf["matrix"]) == len(conf["labels"]) and all(len(r) == len(conf["labels"]) for r in conf["matrix"])
    for name, row in zip(conf["labels"], conf["matrix"]):
        probes = len(components.pool.get(name).probe()) if name != "base" else 0
        assert sum(row) == probes
    i = conf["labels"].index(skill)
    acc = client.get("/v1/skillpool/routing/accuracy").json()["skills"][skill]
    assert conf["matrix"][i][i] / sum(conf["matrix"][i]) == pytest.approx(acc)  # the diagonal is the accuracy


def test_a_skill_shows_its_method_rows_and_gate_numbers(client: TestClient, components, skill: str) -> None:  # type: ignore[no-untyped-def]
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}[skill]
    assert listed["method"] == "isolated" and listed["owner"] is None  # trained without keys: nobody's
    model = client.get(f"/v1/models/{skill}").json()
    stored = components.store.get(skill).meta
    [serving] = [v for v in model["versions"] if v["serving"]]
    assert serving["training"]["method"] == "isolated"
    assert serving["samples"] == stored["samples"] and serving["samples"]["train"] > 0
    assert {"score", "base_score", "trivial_score", "n"} <= set(serving["eval"])
    assert model["quality"]["new"]["bar"] >= max(serving["eval"]["base_score"], serving["eval"]["trivial_score"])
    assert model["quality"]["earlier"] == stored["quality"]["earlier"]


def test_whoami_and_the_routing_views_for_every_role(components, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    keys.write_text(KEYS_FILE)
    with TestClient(create_app(components, KeyRing(path=keys))) as http:
        want = {
            "alice": ("chat", {"retire": False, "rollback": False, "train": False, "fallback_clusters": False}),
            "bob": ("train", {"retire": False, "rollback": False, "train": True, "fallback_clusters": False}),
            "root": ("admin", {"retire": True, "rollback": True, "train": True, "fallback_clusters": True}),
        }
        for who, (role, can) in want.items():
            me = http.get("/v1/skillpool/whoami", headers=auth(who)).json()
            assert me == {"name": who, "role": role, "keys_configured": True, "can": can}
            for path in ("/v1/skillpool/routing", "/v1/skillpool/routing/accuracy", "/v1/skillpool/routing/confusion"):
                assert http.get(path, headers=auth(who)).status_code == 200, (who, path)
            clusters = http.get("/v1/skillpool/fallback_clusters", headers=auth(who)).status_code
            assert clusters == (200 if can["fallback_clusters"] else 403)  # still the admin's alone
        for path in ("/v1/skillpool/whoami", "/v1/skillpool/routing", "/v1/skillpool/routing/confusion"):
            assert_error(http.get(path, headers=auth("unknown")), 401, None, "invalid_api_key")
            assert_error(http.get(path), 401, None, "invalid_api_key")  # chat keys exist: no key, no pool
        assert_error(http.post("/v1/skillpool/whoami", headers=auth("alice")), 403, None, "permission_denied")


def test_whoami_without_keys_and_with_only_an_admin_key(components) -> None:  # type: ignore[no-untyped-def]
    everything = {"retire": True, "rollback": True, "train": True, "fallback_clusters": True}
    with TestClient(create_app(components, KeyRing())) as http:  # single-tenant: a bearer is ignored
        me = http.get("/v1/skillpool/whoami", headers=auth("unknown")).json()
        assert me == {"name": None, "role": "admin", "keys_configured": False, "can": everything}
    with TestClient(create_app(components, KeyRing(admin_key=BEARER["root"]))) as http:
        me = http.get("/v1/skillpool/whoami").json()  # no key: may chat and read the pool, nothing else
        assert me == {
            "name": None,
            "role": "anonymous",
            "keys_configured": True,
            "can": dict.fromkeys(everything, False),
        }
        assert http.get("/v1/skillpool/routing").status_code == 200
        assert http.get("/v1/skillpool/whoami", headers=auth("root")).json()["can"] == everything
