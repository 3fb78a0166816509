"""Locust load test as users run one: chat through the OpenAI API (routed, pinned, streamed) and a trickle of
skill uploads, against a running server.

    SKILLPOOL_DATASETS=DIR .venv/bin/locust -f load_tests/serving/locustfile.py --host http://127.0.0.1:8000 --headless \
        -u 8 -r 2 -t 60s

Prompts and uploads come from the Long Sequence tasks in the datasets folder SKILLPOOL_DATASETS names. Uploads use
a fresh skill name each time (`load-<n>`) with one epoch, so they exercise the queue without piling up work; the
server answers 202, or 429 when its job queue is full (counted as a success: that is the contract).
"""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path

from locust import HttpUser, between, task

from skillpool.evaluation.tasks import dataset_folder, task_lines

TASKS = ["sst-2", "agnews", "yelp", "boolqa"]


def _folder(name: str) -> Path:
    try:
        return dataset_folder("long_sequence", name)
    except ValueError as e:  # the setting is unset or lacks the task: stop with its message
        raise SystemExit(str(e)) from None


def _rows(name: str, n: int = 50) -> list[dict[str, str]]:
    return [json.loads(x) for x in task_lines(_folder(name), "test")[:n]]


# cut to 1000 characters: long reviews would pass a small test model's 512-token context
PROMPTS = [f"{r['instruction']}\n{r['input']}"[:1000] for name in TASKS for r in _rows(name)]
UPLOAD = "\n".join(task_lines(_folder("sst-2"), "train")[:30]).encode()


class ChatUser(HttpUser):
    wait_time = between(0.1, 0.5)

    @task(10)
    def routed(self) -> None:
        body = {"model": "auto", "messages": [{"role": "user", "content": random.choice(PROMPTS)}], "max_tokens": 4}
        self.client.post("/v1/chat/completions", json=body, name="chat auto")

    @task(3)
    def streamed(self) -> None:
        body = {
            "model": "auto",
            "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
            "max_tokens": 4,
            "stream": True,
        }
        with self.client.post(
            "/v1/chat/completions", json=body, name="chat stream", stream=True, catch_response=True
        ) as r:
            text = r.text
            if r.status_code != 200 or not text.rstrip().endswith("data: [DONE]"):
                r.failure(f"stream did not end with [DONE]: {r.status_code} {text[-200:]!r}")

    @task(2)
    def models(self) -> None:
        self.client.get("/v1/models", name="models")


class Uploader(HttpUser):
    """One user that uploads a small dataset every 5-10 s while the chat users run."""

    fixed_count = 1
    wait_time = between(5, 10)

    @task
    def upload(self) -> None:
        data = {"name": f"load-{uuid.uuid4().hex[:8]}", "config": json.dumps({"epochs": 1}), "force": "true"}
        with self.client.post(
            "/tasks", files={"file": ("load.jsonl", UPLOAD)}, data=data, name="upload", catch_response=True
        ) as r:
            if r.status_code in (202, 429):
                r.success()
            else:
                r.failure(f"{r.status_code} {r.text[:200]}")
