"""Fault injection: the data dir is a small real tmpfs, filled during uploads and during a training job. Uploads
and job creation answer 507 and leave nothing behind; the job ends failed with the reason (in memory at once,
on disk once there is room); the trainer lives on and readiness says so; with space back, a skill trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from skillpool.trainer.jobs import local_queue
from tests.conftest import until, wait_job
from tests.datasets import sst2_lines
from tests.disk import fill, small_tmpfs, temp_leftovers

# one wording beside each row: the job as short as the windows below were sized for
FAST = json.dumps({"epochs": 1, "batch_size": 8, "max_seq_len": 256, "prompt_variant_copies": 1})


def _insufficient_storage(resp: Any) -> None:
    assert resp.status_code == 507, resp.text
    err = resp.json()["error"]
    assert err["code"] == "insufficient_storage" and err["type"] == "server_error"
    assert "no space left on device" in err["message"]


def _record(data: Path, job_id: str) -> dict[str, Any]:
    return dict(json.loads((data / "jobs" / f"{job_id}.json").read_text()))


def _chat(http: TestClient, model: str) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
    return http.post("/v1/chat/completions", json=body)


def test_a_full_disk_is_contained_and_a_skill_trains_once_space_is_back(  # type: ignore[no-untyped-def]
    tiny_base, embedder, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(local_queue, "RETRY_SAVE_S", 0.5)
    with small_tmpfs(tmp_path / "data", "8m") as data:
        cfg = ServerConfig.of(data_dir=data, max_upload_bytes=300_000, default_max_tokens=8)
        c = build_components(cfg, base=tiny_base, embedder=embedder)
        try:
            with TestClient(create_app(c)) as http:
                upload = {"file": ("t.jsonl", sst2_lines(40))}
                kept = http.post("/v1/files", files=upload, data={"purpose": "fine-tune"}).json()["id"]

                # 1. uploads and job creation into a full disk: 507, and not a byte or a job left behind
                ballast = fill(data)
                _insufficient_storage(http.post("/v1/files", files=upload, data={"purpose": "fine-tune"}))
                task = {"name": "full", "config": FAST, "force": "true"}
                _insufficient_storage(http.post("/tasks", files=upload, data=task))
                _insufficient_storage(http.post("/v1/fine_tuning/jobs", json={"model": "base", "training_file": kept}))
                assert sorted(p.name for p in (data / "files").iterdir()) == [f"{kept}.json", f"{kept}.jsonl"]
                assert http.get("/tasks").json()["data"] == [] and c.jobs.depth() == 0
                assert list((data / "jobs").iterdir()) == [] and temp_leftovers(data) == []

                # 2. room for the upload, then the disk fills while the job trains
                ballast.unlink()
                r = http.post("/tasks", files={"file": ("s.jsonl", sst2_lines(200))}, data=task)
                assert r.status_code == 202, r.text
                ballast = fill(data)
                job = wait_job(http, r.json()["id"], timeout=300)
                assert job["status"] == "failed" and job["error_code"] == "insufficient_storage", job
                assert "no space left on device" in job["error"] and str(data) not in job["error"]
                assert _record(data, job["id"])["status"] in ("queued", "running")  # no room for the ending yet
                ready = http.get("/readyz")
                assert ready.status_code == 200 and ready.json()["checks"]["trainer"] is True
                assert http.get("/healthz").status_code == 200 and _chat(http, "auto").status_code == 200
                assert 'skillpool_trainer_up{queue="local"} 1.0' in http.get("/metrics").text
                assert temp_leftovers(data) == [] and not (data / "skills" / "full").exists()

                # 3. space again: the record catches up, and the name the failed job held trains a skill
                ballast.unlink()
                until(lambda: _record(data, job["id"])["status"] == "failed", timeout=15)
                assert _record(data, job["id"])["error_code"] == "insufficient_storage"
                again = http.post("/tasks", files=upload, data=task)
                assert again.status_code == 202, again.text
                done = wait_job(http, again.json()["id"], timeout=300)
                assert done["status"] == "succeeded" and done["skill_version"] == 1, done
                forced = _chat(http, "full")
                assert forced.status_code == 200 and forced.headers["x-skillpool-route"] == "full=1.00"
                assert temp_leftovers(data) == [] and c.jobs.trainer_alive()

                # 4. a trainer that is gone is named by readiness and the gauge, and chat goes on
                c.jobs._queue.put(None)  # its thread ends as a crash would end it (close() is a stop on purpose)
                until(lambda: c.jobs.trainer_alive() is False, timeout=15)
                ready = http.get("/readyz")
                assert ready.status_code == 200 and ready.json()["status"] == "ready"
                assert ready.json()["checks"]["trainer"] is False and ready.json()["failing"] == ["trainer"]
                assert 'skillpool_trainer_up{queue="local"} 0.0' in http.get("/metrics").text
                assert _chat(http, "full").status_code == 200
        finally:
            c.close()
