"""Redis going away harms only what needs it: chat, /v1/models and /metrics go on answering 200, uploads get
503 with Retry-After, and when Redis is back an upload is accepted without restarting anything."""

from __future__ import annotations

import uuid

from fastapi.testclient import TestClient

from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from tests.conftest import start_redis
from tests.datasets import sst2_lines


def test_serving_survives_redis_going_away_and_uploads_come_back(tiny_base, embedder, tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc, url = start_redis(tmp_path / "redis")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    cfg = ServerConfig.of(
        data_dir=tmp_path / "data",
        redis_url=url,
        redis_prefix=f"t-{uuid.uuid4().hex[:8]}",
        default_max_tokens=2,
        run_trainer=False,  # queued only: this test is about the queue being reachable
    )
    c = build_components(cfg, base=tiny_base, embedder=embedder)
    upload = {"files": {"file": ("d.jsonl", sst2_lines(12))}, "data": {"name": "s"}}
    try:
        with TestClient(create_app(c)) as h:
            proc.terminate()
            proc.wait(timeout=10)
            chat = h.post(
                "/v1/chat/completions", json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
            )
            assert chat.status_code == 200, chat.text
            assert h.get("/v1/models").status_code == 200
            metrics = h.get("/metrics")
            assert metrics.status_code == 200 and "skillpool_requests_total" in metrics.text
            down = h.post("/tasks", **upload)
            assert down.status_code == 503 and down.headers["retry-after"] == "5", down.text
            assert down.json()["error"]["code"] == "queue_unavailable"
            proc, _ = start_redis(tmp_path / "redis", port)  # back, on the same address
            up = h.post("/tasks", **upload)
            assert up.status_code == 202, up.text
            assert h.get(f"/tasks/{up.json()['id']}").json()["status"] == "queued"
    finally:
        c.close()
        proc.terminate()
        proc.wait(timeout=10)
