"""Concurrent uploads of one skill name: one job gets it (202), the others 409 skill_exists; a new version
while that job is pending is a 409 skill_busy; a job that ends without storing the skill frees the name."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi.testclient import TestClient

from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from tests.conftest import wait_job
from tests.datasets import sst2_lines

FAST = json.dumps({"epochs": 1, "batch_size": 8, "max_seq_len": 256})


def test_one_of_two_concurrent_uploads_of_a_new_name_gets_the_job(tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = build_components(ServerConfig.of(data_dir=tmp_path, default_max_tokens=4), base=tiny_base, embedder=embedder)
    try:
        with TestClient(create_app(c)) as http:
            rows = sst2_lines(200)  # several seconds of key preparation: the winner is still pending meanwhile

            def upload(_: int, **extra: str):  # type: ignore[no-untyped-def]
                return http.post("/tasks", files={"file": ("s.jsonl", rows)}, data={"name": "twin", **extra})

            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(upload, range(4)))
            assert sorted(r.status_code for r in answers) == [202, 409, 409, 409], [r.text for r in answers]
            assert {r.json()["error"]["code"] for r in answers if r.status_code == 409} == {"skill_exists"}
            [winner] = [r.json() for r in answers if r.status_code == 202]
            assert [j["id"] for j in http.get("/tasks").json()["data"]] == [winner["id"]] and c.jobs.depth() == 1

            busy = upload(0, new_version="true")
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "skill_busy", busy.text
            assert http.delete(f"/tasks/{winner['id']}").status_code == 200
            assert wait_job(http, winner["id"], timeout=60)["status"] == "cancelled"

            again = upload(0, config=FAST)  # the cancelled job stored nothing and freed the name
            assert again.status_code == 202, again.text
            http.delete(f"/tasks/{again.json()['id']}")
            assert wait_job(http, again.json()["id"], timeout=60)["status"] == "cancelled"
    finally:
        c.close()
