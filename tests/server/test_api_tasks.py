"""The task API on a tiny LLaMA with the real router, in the order a user meets it: bad uploads refused, an upload
trained and hot-registered, a new version, the quality gate, a cancelled job, a restart; then requests that need
that registered skill (explicit and hostile mixes, a skill retired mid-request). The tests share one server and run
in file order."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from skillpool.server.bootstrap import build_components
from tests.conftest import wait_job
from tests.datasets import dataset_dir, sst2_lines
from tests.server.test_api import assert_error, chat

# one epoch at batch 8: the upload tests train a random tiny model, whose skill learns nothing anyway
FAST = json.dumps({"epochs": 1, "batch_size": 8, "max_seq_len": 256})


def test_bad_uploads_are_rejected_and_nothing_is_stored(client: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    good = sst2_lines(12).splitlines()
    bad = b"\n".join([good[0], b"{broken", good[2], b'{"instruction": "x", "output": ""}', *good[4:]])
    err = assert_error(
        client.post("/tasks", files={"file": ("d.jsonl", bad)}, data={"name": "sst-2"}), 400, "file", "invalid_dataset"
    )
    assert [(e["line"], e["field"]) for e in err["errors"]] == [(2, ""), (4, "output")]
    assert "line 2" in err["message"] and "line 4" in err["message"]
    refused: list[tuple[dict[str, str], str, str | None]] = [  # (form fields, param, code) beside a good file
        ({"name": "../x"}, "name", "invalid_name"),
        ({"name": "auto"}, "name", "invalid_name"),
        ({"name": "s", "config": '{"rank": -1}'}, "config.rank", None),
        ({"name": "s", "config": "{"}, "config", None),
        ({"name": "s", "config": '{"epochs": 101}'}, "config", None),  # a limit across fields: the config itself
        # `$` would let a trailing newline through; the name then breaks every routed request
        ({"name": "abc\n"}, "name", "invalid_name"),
        # json.loads takes NaN: refused now, not a 500 in the trainer later
        ({"name": "s", "config": '{"alpha": NaN}'}, "config.alpha", None),
        ({"name": "s", "method": "magic"}, "method", None),
        ({"name": "s", "force": "maybe"}, "force", None),
    ]
    for data, param, code in refused:
        assert_error(client.post("/tasks", files={"file": ("d.jsonl", sst2_lines(12))}, data=data), 400, param, code)
    err = assert_error(
        client.post("/tasks", files={"file": ("d.jsonl", sst2_lines(12))}, data={"name": "s", "method": "sapt"}),
        400,
        "method",
    )
    assert "--router-mode sapt" in err["message"]  # this server routes with dtkr
    assert_error(
        client.post("/tasks", files={"file": ("d.jsonl", sst2_lines(3))}, data={"name": "s"}),
        400,
        "file",
        "invalid_dataset",
    )
    assert_error(client.post("/tasks", files={"name": (None, "s")}), 400, "file", "missing_file")
    assert_error(client.post("/tasks", files={"file": ("d.jsonl", sst2_lines(12))}), 400, "name", "missing_name")
    assert_error(client.post("/tasks", data={"name": "s"}), 400, None, "invalid_content_type")
    assert_error(
        client.post("/tasks", files={"file": ("d.jsonl", b"x" * 400_000)}, data={"name": "s"}),
        413,
        "file",
        "file_too_large",
    )
    assert client.get("/tasks").json()["data"] == []
    assert components.store.list_latest() == []
    assert_error(client.get("/tasks/job-nope"), 404, "id", "task_not_found")


def test_upload_trains_and_hot_registers_a_skill(client: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    # a random tiny model learns nothing, so the quality gate would refuse it: `force` registers it anyway
    r = client.post(
        "/tasks",
        files={"file": ("sst2.jsonl", sst2_lines(40))},
        data={"name": "sst-2", "config": FAST, "force": "true"},
    )
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] in ("queued", "running") and job["skill"] == "sst-2" and job["examples"] == 40
    assert set(job) >= {"id", "status", "skill", "progress", "eval", "error"}
    done = wait_job(client, job["id"])
    assert done["status"] == "succeeded", done
    assert done["progress"]["step"] == done["progress"]["total"] > 0 and done["progress"]["loss"] is not None
    assert done["eval"]["metric"] == "exact_match" and done["eval"]["n"] == 4
    quality = components.store.get("sst-2").meta["quality"]
    assert quality["forced"] and not quality["passed"] and "below the bar" in quality["reasons"][0]
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["sst-2"]["parent"] == "tiny-llama" and models["sst-2"]["version"] == 1
    forced = chat(client, "anything", model="sst-2")
    assert forced.headers["x-skillpool-route"] == "sst-2=1.00" and forced.json()["skillpool"]["reason"] == "forced"
    test_line = json.loads(
        (dataset_dir("long_sequence", "sst-2") / "test.jsonl").read_text(encoding="utf-8").split("\n")[0]
    )
    routed = chat(client, test_line["instruction"] + "\n" + test_line["input"])
    assert routed.json()["skillpool"]["route"][0]["skill"] == "sst-2"
    assert routed.headers["x-skillpool-route"].startswith("sst-2=")
    off_topic = chat(client, "Write a limerick about a penguin who learns to fly.")
    assert (
        off_topic.json()["skillpool"]["reason"] == "below_threshold"
        and off_topic.headers["x-skillpool-route"] == "base"
    )
    demand = client.get("/v1/skillpool/fallback_clusters").json()  # the limerick is demand no skill serves
    [cluster] = [c for c in demand["data"] if any("penguin" in e for e in c["examples"])]
    assert cluster["count"] >= 1 and cluster["nearest_skills"][0]["skill"] == "sst-2" and demand["observed"] >= 1
    assert "skillpool_fallback_clusters 1.0" in client.get("/metrics").text
    assert_error(client.delete(f"/tasks/{job['id']}"), 409, "id", "task_finished")
    # the stored skill is a plain PEFT adapter
    from peft import PeftConfig

    rec = components.store.get("sst-2")
    assert PeftConfig.from_pretrained(str(rec.path)).base_model_name_or_path == "tiny-llama"
    metrics = client.get("/metrics").text
    assert 'skillpool_training_jobs_total{status="succeeded"} 1.0' in metrics
    assert 'skillpool_route_decisions_total{reason="forced",skill="sst-2"}' in metrics
    assert 'skillpool_route_fallbacks_total{reason="below_threshold"}' in metrics
    assert "skillpool_time_to_first_token_seconds_count" in metrics
    assert 'skillpool_routing_accuracy{skill="sst-2"} 1.0' in metrics  # its 4 held-out probes route to it


def test_an_existing_skill_gets_a_new_version_only_when_asked(client: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    """Runs after the upload test registered sst-2 v1: the same name again is a 409 that says how."""
    assert components.store.get("sst-2") is not None
    again = {"file": ("s.jsonl", sst2_lines(12))}
    r = client.post("/tasks", files=again, data={"name": "sst-2", "config": FAST})
    assert_error(r, 409, "name", "skill_exists")
    assert "new_version=true" in r.json()["error"]["message"]
    assert_error(
        client.post("/tasks", files=again, data={"name": "sst-2", "new_version": "perhaps"}),
        400,
        "new_version",
        "invalid_new_version",
    )
    ok = client.post(
        "/tasks", files=again, data={"name": "sst-2", "config": FAST, "new_version": "true", "force": "true"}
    )
    assert ok.status_code == 202, ok.text
    assert any("trains version 2" in e["message"] for e in ok.json()["events"])
    assert wait_job(client, ok.json()["id"])["skill_version"] == 2


def test_quality_gate_refuses_a_skill_that_learned_nothing(client: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    r = client.post(
        "/tasks",
        files={"file": ("s.jsonl", sst2_lines(40))},
        data={"name": "sst-2-again", "config": FAST, "method": "kif"},
    )
    done = wait_job(client, r.json()["id"])
    assert done["status"] == "failed" and done["error"].startswith("quality gate: new skill scores"), done
    report = done["eval"]
    assert not report["passed"] and not report["forced"]
    assert report["new"]["score"] < report["new"]["bar"] and report["new"]["n"] == 4
    assert set(report["earlier"]) == {"sst-2"}  # the registered skill's probes were re-checked through the routed pool
    assert {"before", "after", "drop", "n", "rerouted"} <= set(report["earlier"]["sst-2"])
    assert components.store.get("sst-2-again") is None and not list(components.store.tmp_dir.iterdir())
    assert "sst-2-again" not in [m["id"] for m in client.get("/v1/models").json()["data"]]


def test_cancel_a_job(client: TestClient) -> None:
    r = client.post(
        "/tasks",
        files={"file": ("s.jsonl", sst2_lines(200))},
        data={"name": "slow", "config": json.dumps({"epochs": 20})},
    )
    job_id = r.json()["id"]
    assert client.delete(f"/tasks/{job_id}").status_code == 200
    assert wait_job(client, job_id)["status"] == "cancelled"
    assert "slow" not in [m["id"] for m in client.get("/v1/models").json()["data"]]


def test_restart_serves_stored_skills(components, tiny_base, embedder) -> None:  # type: ignore[no-untyped-def]
    again = build_components(components.cfg, base=tiny_base, embedder=embedder)
    try:
        assert [r.name for r in again.pool.records()] == ["sst-2"]
        assert {j.id for j in again.jobs.list()} == {j.id for j in components.jobs.list()}
    finally:
        again.close()


def test_an_explicit_mix_is_forced_and_bad_mixes_are_rejected(client: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    names = [r.name for r in components.pool.records()]
    assert names, "needs the skill trained by an earlier test"
    resp = chat(client, "Hello there", model=f"{names[0]}=3,{names[0]}=1")
    assert resp.status_code == 200, resp.text
    assert resp.json()["skillpool"]["route"] == [{"skill": names[0], "weight": 1.0}]
    assert resp.json()["skillpool"]["reason"] == "forced"
    assert_error(chat(client, "Hi", model=f"{names[0]}=nan"), 400, "model", "invalid_value")
    assert_error(chat(client, "Hi", model="nope=1"), 404, "model", "model_not_found")


@pytest.mark.parametrize(
    "weights,temperature",
    [("1e308,{s}=1e308", 0.7), ("1e308,{s}=1e308", 0), ("inf", 0), ("1e7", 0.5), ("-0", 0)],
)
def test_a_hostile_mix_is_a_400_and_the_engine_stays_up(client: TestClient, components, weights, temperature) -> None:  # type: ignore[no-untyped-def]
    """The issue's request: two weights of 1e308 summed to inf, inf/inf to NaN, and sampling killed the engine."""
    name = next(iter(components.pool.records())).name
    resp = chat(client, "hello", model=f"{name}={weights.format(s=name)}", temperature=temperature, max_tokens=4)
    assert_error(resp, 400, "model", "invalid_value")
    assert client.get("/healthz").status_code == 200
    assert chat(client, "hello", model=f"{name}=1e-320", temperature=temperature, max_tokens=4).status_code == 200


def test_a_skill_retired_between_routing_and_the_engine_is_a_404(client: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    rec = next(iter(components.pool.records()), None)
    assert rec is not None, "needs the skill trained by an earlier test"
    components.engine.remove_skill(rec.name)  # the router still knows it: as if it retired mid-request
    try:
        assert_error(chat(client, "Hello there", model=rec.name), 404, "model", "model_not_found")
        assert chat(client, "Hello there").status_code == 200  # the next request is served as usual
    finally:
        components.engine.add_skill(rec.name, rec.adapter)
    assert chat(client, "Hello there", model=rec.name).status_code == 200
