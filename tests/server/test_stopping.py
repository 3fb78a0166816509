"""The server's stop (server/stopping.py) on a real uvicorn server with the tiny LLaMA: the first stop signal drains
the stream in flight to its finish_reason while the in-process trainer stops (its job ends `failed`,
`server_stopped`), then the server returns; later signals change nothing. The signals themselves, and the processes
a server starts, are tested end to end (tests/e2e/test_stop_e2e.py). The deploy files give a stop the time it
needs."""

from __future__ import annotations

import argparse
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml

from skillpool.evaluation.process import free_port
from skillpool.runtime.processes import SHUTDOWN_TIMEOUT_S
from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from skillpool.server.stopping import CLOSE_BUDGET_S, DrainingServer
from tests.conftest import until
from tests.datasets import sst2_lines


@pytest.fixture
def components(tiny_long, embedder, tmp_path):  # type: ignore[no-untyped-def]
    c = build_components(ServerConfig.of(data_dir=tmp_path / "data"), base=tiny_long, embedder=embedder)
    yield c
    c.close()


@pytest.fixture
def server(components: Any) -> Iterator[tuple[DrainingServer, str, threading.Thread]]:
    app = create_app(components)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    srv = DrainingServer(config, app.state.drain, components, timeout_s=600)
    thread = threading.Thread(target=srv.run, daemon=True)  # not the main thread: no handlers are installed
    thread.start()
    until(lambda: srv.started, timeout=30)
    yield srv, f"http://127.0.0.1:{port}", thread
    srv.should_exit = True
    thread.join(15)


def test_the_first_signal_drains_stops_training_and_ends_the_server(server: Any, components: Any) -> None:
    srv, url, thread = server
    r = httpx.post(  # forced: a random tiny model cannot pass the quality gate
        url + "/tasks",
        files={"file": ("sst-2.jsonl", sst2_lines(40))},
        data={"name": "sst-2", "config": json.dumps({"epochs": 100}), "force": "true"},
        timeout=60,
    )
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]

    def job() -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{url}/tasks/{job_id}", timeout=10).json()
        return body

    until(lambda: job()["status"] == "running" and (job()["progress"]["step"] or 0) >= 1, timeout=300)
    body = {"model": "base", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1500, "ignore_eos": True}
    with (
        httpx.Client(timeout=300) as cl,
        cl.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as stream,
    ):
        lines = stream.iter_lines()
        next(x for x in lines if '"content": "' in x and '"content": ""' not in x)
        srv.handle_exit(signal.SIGTERM, None)
        srv.handle_exit(signal.SIGTERM, None)  # one stop: a repeat (not a signal) changes nothing
        rest = [x for x in lines if x]
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
    thread.join(120)
    assert not thread.is_alive()  # drained, then uvicorn closed
    stopped = components.jobs.get(job_id)
    assert (stopped.status, stopped.error_code) == ("failed", "server_stopped")
    assert components.store.get("sst-2") is None and list(components.store.tmp_dir.iterdir()) == []


DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _serve_timeout(args: list[str]) -> float:
    """--shutdown-timeout as `skillpool serve` parses these arguments (its default when absent)."""
    p = argparse.ArgumentParser()
    ServerConfig.add_cli_args(p)
    known, _ = p.parse_known_args(args)
    return ServerConfig.from_cli_args(known).http.shutdown_timeout_s


def test_the_deploy_files_leave_the_drain_and_the_close_time_before_sigkill() -> None:
    """Kubernetes and Compose send SIGKILL after their grace period: the drain and the close must fit in it, and a
    failing readiness probe must take a replica out within the drain."""
    from skillpool.trainer.jobs.worker import add_arguments as worker_arguments

    server = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    (container,) = server["containers"]
    timeout = _serve_timeout(container["args"][2:])
    assert server["terminationGracePeriodSeconds"] >= timeout + CLOSE_BUDGET_S
    ready = container["readinessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] <= timeout

    worker = yaml.safe_load((DEPLOY / "k8s" / "worker.yaml").read_text())["spec"]["template"]["spec"]
    p = argparse.ArgumentParser()
    worker_arguments(p)
    worker_timeout = p.parse_known_args(["--redis-url", "redis://r", *worker["containers"][0]["args"][2:]])[0]
    assert worker["terminationGracePeriodSeconds"] >= worker_timeout.shutdown_timeout + CLOSE_BUDGET_S

    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    for name in ("skillpool", "worker"):  # both run with the default timeout
        grace = float(compose[name]["stop_grace_period"].removesuffix("s"))
        assert grace >= SHUTDOWN_TIMEOUT_S + CLOSE_BUDGET_S, name
