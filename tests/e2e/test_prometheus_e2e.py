"""Debian's real Prometheus scrapes live processes that have had traffic (a trained skill, a job failed at the
quality gate, a job cancelled mid-training, routed, fallen-back and labelled chat), in both layouts: a server that
trains in-process, and a server that only enqueues beside a `skillpool worker` on Redis. Every Grafana panel's
PromQL then goes through Prometheus' HTTP API (as Grafana sends it: a range query, or an instant one) and must
return data, every alert rule must load and evaluate, the process that trains reports each job once, and the
series of a job that ended and of a skill that was retired leave the next scrape. The servers have keys, so
Prometheus scrapes them with the bearer token deploy/'s scrape config sends (a key of role metrics)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from skillpool.evaluation.process import ServerProcess, free_port
from skillpool.evaluation.tasks_client import TasksClient
from tests.conftest import until
from tests.datasets import sst2_lines
from tests.e2e.prometheus_process import DEPLOY, Prometheus

pytestmark = pytest.mark.slow
SKILL = "sst-2"
LONG = "cancelled"  # a job long enough to be scraped mid-training (one row per step), cancelled once it was
RETIRED_SERIES = ("skillpool_routing_accuracy", "skillpool_skill_eval_score")
SCRAPER, ROOT = "k-scrape-0001", "k-root-0002"  # --metrics-api-key (Prometheus'), --admin-api-key (the test's)
KEYS = ["--metrics-api-key", SCRAPER, "--admin-api-key", ROOT]
AS_ADMIN = {"authorization": f"Bearer {ROOT}"}
PROGRESS_SERIES = (
    "skillpool_training_step",
    "skillpool_training_steps",
    "skillpool_training_loss",
    "skillpool_training_tokens_per_second",
)


class Panel(NamedTuple):
    title: str
    expr: str
    instant: bool  # Grafana sends an instant query (bar gauges of the latest value), else a range query


def panel_queries(range_s: int = 600) -> list[Panel]:
    """Every target of the dashboard, Grafana's variables filled in (every instance, a 30 s rate window)."""
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "skillpool.json").read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            if target.get("expr"):
                expr = re.sub(r'"\$\{?\w+\}?"', '".*"', target["expr"]).replace("$__rate_interval", "30s")
                out.append(Panel(panel["title"], expr.replace("$__range", f"{range_s}s"), bool(target.get("instant"))))
    return out


def test_every_panel_has_data_and_a_retired_skill_leaves_with_an_in_process_trainer(tiny_base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    args = ["--model", str(tiny_base.path), "--default-max-tokens", "3", *KEYS]
    with (
        ServerProcess(tmp_path / "data", args) as srv,
        Prometheus(tmp_path, {"skillpool": [srv.port]}, tokens={"skillpool": SCRAPER}) as prom,
    ):
        _exercise_and_check(srv, prom, trainer_job="skillpool")


def test_every_panel_has_data_and_a_retired_skill_leaves_with_redis_workers(  # type: ignore[no-untyped-def]
    tiny_base, redis_url: str, tmp_path: Path
) -> None:
    data, prefix, metrics_port = tmp_path / "data", f"prom-{uuid.uuid4().hex[:8]}", free_port()
    redis = ["--redis-url", redis_url, "--redis-prefix", prefix]
    args = [*redis, "--no-trainer", "--model", str(tiny_base.path), "--default-max-tokens", "3", *KEYS]
    with (
        ServerProcess(data, args) as srv,
        _worker([*redis, "--data-dir", str(data), "--model", str(tiny_base.path)], metrics_port, tmp_path) as worker,
        Prometheus(
            tmp_path, {"skillpool": [srv.port], "skillpool-worker": [metrics_port]}, tokens={"skillpool": SCRAPER}
        ) as prom,
    ):
        _exercise_and_check(srv, prom, trainer_job="skillpool-worker", worker=worker)


@contextmanager
def _worker(args: list[str], metrics_port: int, folder: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A `skillpool worker` exporting its metrics on `metrics_port`, once that answers."""
    cmd = [sys.executable, "-m", "skillpool.cli.main", "worker", *args, "--metrics-port", str(metrics_port)]
    log = folder / "worker.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:

        def answers() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        until(answers, timeout=300)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _exercise_and_check(
    srv: ServerProcess, prom: Prometheus, trainer_job: str, worker: subprocess.Popen[bytes] | None = None
) -> None:
    """The traffic, then the checks both layouts share: panels, rules, training metrics from the scrape job of
    the process that trains (`trainer_job`), each job counted once, retirement."""
    assert httpx.get(srv.url + "/metrics", timeout=30).status_code == 401  # only with the scraper's key
    started = time.time()
    # a skill trained (forced past the gate a random model cannot pass), one job failed at the gate
    trained = _wait(srv, _upload(srv, SKILL, 30, force=True))
    assert trained["status"] == "succeeded", (trained.get("error"), srv.log_tail())
    assert _wait(srv, _upload(srv, "gated", 30, force=False))["status"] == "failed"
    _scrape_mid_training_then_cancel(srv, prom, trainer_job)
    # with workers, the server serves the skill once it reads the worker's event
    until(lambda: SKILL in [m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]], 60)
    _chat(srv, prom)

    window = (started - 5, time.time())  # what a dashboard over the test's minutes shows
    errors, empty = [], []
    for title, expr, instant in panel_queries(int(window[1] - window[0]) + 1):
        try:
            result = prom.query(expr) if instant else prom.query_range(expr, *window)
        except AssertionError as e:
            errors.append((title, expr, str(e)))
            continue
        if not result:
            empty.append((title, expr))
    assert not errors, errors
    assert not empty, empty

    rules = prom.rules()
    names = re.findall(r"- alert: (\S+)", (DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert sorted(r["name"] for r in rules) == sorted(names)
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

    # the process that trains reports its jobs, its progress and itself; a job is counted once over all targets
    for selector in (f'{{job="{trainer_job}"}}', ""):
        ended = prom.query(f"sum by (status) (skillpool_training_jobs_total{selector})")
        by_status = {r["metric"]["status"]: float(r["value"][1]) for r in ended}
        assert by_status == {"succeeded": 1.0, "failed": 1.0, "cancelled": 1.0}, selector
    assert [r["value"][1] for r in prom.query(f'skillpool_trainer_up{{job="{trainer_job}"}}')] == ["1"]

    for name in RETIRED_SERIES:
        assert prom.query(f'{name}{{skill="{SKILL}"}}'), f"{name} has no {SKILL} series before it is retired"
    r = httpx.delete(f"{srv.url}/v1/models/{SKILL}", headers=AS_ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    retired = time.time()
    until(lambda: prom.scraped_since(retired), timeout=60)  # every target scraped once more
    for name in RETIRED_SERIES:
        assert prom.query(f'{name}{{skill="{SKILL}"}}') == [], f"{name} still has the retired {SKILL}"
    live = {s["metric"]["__name__"] for s in prom.query(f'{{skill="{SKILL}"}}')}
    assert not {n for n in live if prom.metric_type(n) == "gauge"}, live  # counters keep their history
    if worker is not None:
        assert worker.poll() is None  # it kept running through it all


def _scrape_mid_training_then_cancel(srv: ServerProcess, prom: Prometheus, trainer_job: str) -> None:
    """A long job's progress series, scraped from the process that trains while it trains, leave once it ends
    (here: cancelled, the third status)."""
    job_id = _upload(srv, LONG, 300, force=True, batch_size=1)

    def scraped() -> bool:
        status = TasksClient(srv.url, ROOT).job(job_id)["status"]
        assert status in ("queued", "running"), f"{LONG} ended ({status}) before Prometheus saw it train"
        found = prom.query(f'{{__name__=~"{"|".join(PROGRESS_SERIES)}", job="{trainer_job}", skill="{LONG}"}}')
        return {s["metric"]["__name__"] for s in found} == set(PROGRESS_SERIES)

    until(scraped, timeout=300)
    assert TasksClient(srv.url, ROOT).cancel(job_id).status_code == 200
    assert _wait(srv, job_id)["status"] == "cancelled"
    ended = time.time()
    until(lambda: prom.scraped_since(ended), timeout=60)
    assert prom.query(f'{{__name__=~"{"|".join(PROGRESS_SERIES)}", skill="{LONG}"}}') == []


def _upload(srv: ServerProcess, name: str, rows: int, force: bool, batch_size: int = 8) -> str:
    job = TasksClient(srv.url, ROOT).upload(
        name, sst2_lines(rows), config={"epochs": 1, "batch_size": batch_size}, force=force
    )
    return str(job["id"])


def _wait(srv: ServerProcess, job_id: str) -> dict[str, Any]:
    return TasksClient(srv.url, ROOT).follow(job_id, progress=False, poll_s=0.5, gone=srv.exited, timeout_s=600)


def _chat(srv: ServerProcess, prom: Prometheus, scrapes: int = 6) -> None:
    """Routed (labelled with the skill it expects) and fallen-back chat until Prometheus has scraped it for a
    while: enough samples for every rate window."""
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key=ROOT, max_retries=0, timeout=120)
    rows = [json.loads(x) for x in sst2_lines(3).splitlines()]
    since = time.time()
    while not prom.scraped_since(since + scrapes):
        for row in rows:
            client.chat.completions.create(
                model="auto",
                messages=[{"role": "user", "content": f"{row['instruction']}\n{row['input']}"}],
                max_tokens=3,
                metadata={"expected_skill": SKILL},
            )
        client.chat.completions.create(
            model="auto", messages=[{"role": "user", "content": "Write a haiku about Rust."}], max_tokens=3
        )
