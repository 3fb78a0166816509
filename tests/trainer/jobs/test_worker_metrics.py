"""`skillpool worker --metrics-port` serves the training metrics over HTTP: a real worker process on a real Redis
reports its trainer up, the shared queue's queued and running jobs (as the server that enqueued them does), the
running job's progress while it trains, and once the job ends, its ending and no progress series."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from skillpool.evaluation.process import free_port
from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from tests.conftest import until
from tests.datasets import sst2_lines

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_a_worker_exports_its_training_metrics(redis_url, tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    prefix, port = f"t-{uuid.uuid4().hex[:8]}", free_port()
    cfg = ServerConfig.of(data_dir=tmp_path / "data", redis_url=redis_url, redis_prefix=prefix, run_trainer=False)
    server = build_components(cfg, base=tiny_base, embedder=embedder)
    cmd = [sys.executable, "-m", "skillpool.cli.main", "worker", "--redis-url", redis_url, "--redis-prefix", prefix]
    cmd += ["--data-dir", str(cfg.storage.data_dir), "--model", str(tiny_base.path), "--threads", "1"]
    cmd += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
    log = tmp_path / "worker.log"
    worker: subprocess.Popen[bytes] | None = None
    try:
        with TestClient(create_app(server)) as http:

            def served() -> Samples:
                return parse(http.get("/metrics").text)

            config = json.dumps({"epochs": 20})
            r = http.post(
                "/tasks", files={"file": ("s.jsonl", sst2_lines(200))}, data={"name": "long", "config": config}
            )
            assert r.status_code == 202, r.text
            job = r.json()["id"]
            m = served()  # no worker yet: queued, and this server runs no trainer to report
            assert (value(m, "skillpool_training_jobs_queued"), value(m, "skillpool_training_jobs_running")) == (1, 0)
            assert not [name for name, _ in m if name == "skillpool_trainer_up"]

            with log.open("ab") as out:
                env = {**os.environ, "HF_HUB_OFFLINE": "1"}
                worker = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

            def scraped() -> Samples:
                assert worker is not None and worker.poll() is None, log.read_text()[-3000:]
                return parse(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)

            def progressed() -> bool:
                return (http.get(f"/tasks/{job}").json()["progress"]["step"] or 0) >= 1

            until(progressed, timeout=300)
            w = scraped()
            assert value(w, "skillpool_trainer_up", queue="redis") == 1
            assert (value(w, "skillpool_training_jobs_queued"), value(w, "skillpool_training_jobs_running")) == (0, 1)
            assert value(served(), "skillpool_training_jobs_running") == 1  # the same shared queue, read by both
            steps = value(w, "skillpool_training_steps", skill="long")
            assert steps is not None and 1 <= (value(w, "skillpool_training_step", skill="long") or 0) <= steps
            assert (value(w, "skillpool_training_tokens_per_second", skill="long") or 0) > 0

            assert http.delete(f"/tasks/{job}").status_code == 200  # the worker sees the cancel and ends the job
            until(lambda: http.get(f"/tasks/{job}").json()["status"] == "cancelled", timeout=300)
            w = scraped()
            assert value(w, "skillpool_training_jobs_total", status="cancelled") == 1  # counted where it ended
            assert not [name for name, labels in w if ("skill", "long") in labels]
            assert value(w, "skillpool_training_jobs_running") == 0
            assert not [name for name in dict(w) if not name[0].startswith("skillpool_")]  # its registry only
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=60)
        server.close()
