"""A Redis that hangs (CLIENT PAUSE) holds only the requests that need it: the job-queue handlers run off the
event loop, so chat and /healthz on the same server answer while a /tasks listing waits for Redis."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from skillpool.evaluation.process import ServerProcess
from tests.conftest import start_redis

pytestmark = pytest.mark.slow
PAUSE_MS = 5000


def test_a_hanging_redis_does_not_stall_chat(tiny_base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    proc, url = start_redis(tmp_path / "redis")
    try:
        args = ["--model", str(tiny_base.path), "--redis-url", url, "--default-max-tokens", "2"]
        with ServerProcess(tmp_path / "data", args) as srv:
            done: dict[str, float] = {}
            sent = threading.Event()

            def trace(event: str, _info: object) -> None:
                if event.endswith("send_request_body.complete"):
                    sent.set()

            def list_tasks() -> None:
                with httpx.Client(timeout=60) as client:
                    assert client.get(srv.url + "/tasks", extensions={"trace": trace}).status_code == 200
                done["tasks"] = time.perf_counter()

            redis.Redis.from_url(url).execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL")
            waiting = threading.Thread(target=list_tasks)
            waiting.start()
            # sent in full before chat is: the server reads it first, and its Redis call blocks on the pause
            assert sent.wait(30)
            chat = httpx.post(
                srv.url + "/v1/chat/completions",
                json={"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                timeout=60,
            )
            health = httpx.get(srv.url + "/healthz", timeout=60)
            answered = time.perf_counter()
            waiting.join(60)
            assert chat.status_code == 200 and health.status_code == 200, chat.text
            # ordering, not timing: chat and health were answered while the listing still waited for Redis
            assert "tasks" in done and answered < done["tasks"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
