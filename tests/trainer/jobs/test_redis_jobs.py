"""The Redis job queue against the real Redis: a server that only enqueues, a worker elsewhere that
trains into the shared store, and the skill_registered event that makes the server serve it."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from fastapi.testclient import TestClient

from skillpool.adapters_store.store import SkillStore
from skillpool.router import Router
from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from skillpool.trainer.bus import RedisEventBus, announcer
from skillpool.trainer.jobs.redis_queue import RedisJobQueue
from skillpool.trainer.jobs.runner import make_runner
from skillpool.trainer.skill_trainer import SkillTrainer
from tests.conftest import wait_job
from tests.datasets import dataset_dir


@pytest.fixture
def prefix() -> str:
    return f"skillpool-test-{uuid.uuid4().hex[:8]}"


def test_worker_elsewhere_trains_and_every_server_serves(redis_url, prefix, tiny_base, embedder, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = ServerConfig.of(
        data_dir=tmp_path, redis_url=redis_url, redis_prefix=prefix, run_trainer=False, default_max_tokens=4
    )
    server = build_components(cfg, base=tiny_base, embedder=embedder)
    trainer = SkillTrainer(SkillStore(tmp_path), Router(embedder), tiny_base)
    bus = RedisEventBus(redis_url, prefix)  # the worker's: it announces what it stored
    worker = RedisJobQueue(redis_url, make_runner(trainer), announcer(bus), prefix=prefix)
    lines = (dataset_dir("long_sequence", "sst-2") / "train.jsonl").read_bytes().splitlines()
    try:
        with TestClient(create_app(server)) as client:
            r = client.post(
                "/tasks",
                files={"file": ("s.jsonl", b"\n".join(lines[:30]))},
                data={"name": "sst-2", "config": json.dumps({"epochs": 1}), "force": "true"},
            )
            assert r.status_code == 202, r.text
            job = wait_job(client, r.json()["id"])
            assert job["status"] == "succeeded" and job["skill_version"] == 1, job
            assert [j["id"] for j in client.get("/tasks").json()["data"]] == [job["id"]]
            assert "trainer" not in client.get("/readyz").json()["checks"]  # workers elsewhere train
            deadline = time.time() + 30
            while "sst-2" not in [m["id"] for m in client.get("/v1/models").json()["data"]] and time.time() < deadline:
                time.sleep(0.2)
            assert server.pool.get("sst-2") is not None, "the skill_registered event did not reach the server"
            forced = client.post(
                "/v1/chat/completions", json={"model": "sst-2", "messages": [{"role": "user", "content": "hi"}]}
            )
            assert forced.headers["x-skillpool-route"] == "sst-2=1.00"

            # A cancelled job ends cancelled whether the worker had taken it or not.
            r = client.post(
                "/tasks",
                files={"file": ("s.jsonl", b"\n".join(lines[:200]))},
                data={"name": "slow", "config": json.dumps({"epochs": 20})},
            )
            job_id = r.json()["id"]
            assert server.jobs.depth() == 1  # queued or running, counted without reading every record
            assert client.delete(f"/tasks/{job_id}").status_code == 200
            assert wait_job(client, job_id)["status"] == "cancelled"
            assert server.jobs.depth() == 0
            assert server.pool.get("slow") is None
    finally:
        worker.close()
        bus.close()
        server.close()


def test_unreachable_redis_is_a_clear_error(tiny_base, embedder, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = ServerConfig.of(data_dir=tmp_path).replace(redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(ConnectionError, match="cannot reach Redis"):
        build_components(cfg, base=tiny_base, embedder=embedder)
