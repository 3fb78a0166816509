"""Debian's real Prometheus scrapes a live server that has had traffic (a trained skill, a job failed at the
quality gate, routed, fallen-back and labelled chat); every Grafana panel's PromQL then goes through
Prometheus' HTTP API and must parse and return data, and every alert rule must load and evaluate."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from skillpool.evaluation.process import ServerProcess, free_port
from tests.conftest import sst2_lines, until

pytestmark = pytest.mark.slow
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of the dashboard, Grafana's variables filled in."""
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "skillpool.json").read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            if target.get("expr"):
                expr = target["expr"].replace('"$instance"', '".*"').replace("$__rate_interval", "30s")
                out.append((panel["title"], expr.replace("$__range", "10m")))
    return out


def _upload(url: str, name: str, rows: int, force: bool) -> str:
    r = httpx.post(
        url + "/tasks",
        files={"file": (f"{name}.jsonl", sst2_lines(rows))},
        data={"name": name, "config": json.dumps({"epochs": 1}), "force": str(force).lower()},
        timeout=120,
    )
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def _wait(url: str, job_id: str) -> dict:  # type: ignore[type-arg]
    until(lambda: httpx.get(f"{url}/tasks/{job_id}").json()["status"] in ("succeeded", "failed"), timeout=600)
    return dict(httpx.get(f"{url}/tasks/{job_id}").json())


def test_every_panel_and_rule_returns_data_from_a_real_prometheus(tiny_base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    exe = shutil.which("prometheus")
    assert exe, "prometheus is missing: apt-get install prometheus (.ci/run installs it)"
    with ServerProcess(tmp_path / "data", ["--model", str(tiny_base.path), "--default-max-tokens", "3"]) as srv:
        # traffic: a skill trained (forced past the gate a random model cannot pass), one job failed at the gate
        assert _wait(srv.url, _upload(srv.url, "sst-2", 30, force=True))["status"] == "succeeded"
        assert _wait(srv.url, _upload(srv.url, "gated", 30, force=False))["status"] == "failed"
        prom_port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: ['{DEPLOY / 'prometheus' / 'alerts.yml'}']\n"
            "scrape_configs:\n"
            f"  - job_name: skillpool\n    static_configs: [{{targets: ['127.0.0.1:{srv.port}']}}]\n"
        )
        log = (tmp_path / "prometheus.log").open("wb")
        prom = subprocess.Popen(
            [
                exe,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        try:

            def ready() -> bool:
                try:
                    return httpx.get(f"http://127.0.0.1:{prom_port}/-/ready", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            until(ready, timeout=60)
            from openai import OpenAI

            client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            sst2 = [json.loads(x) for x in sst2_lines(8).splitlines()]
            deadline = time.time() + 20  # chat for 20 s of 1 s scrapes: routed, fallen back, labelled
            while time.time() < deadline:
                for row in sst2[:3]:
                    client.chat.completions.create(
                        model="auto",
                        messages=[{"role": "user", "content": f"{row['instruction']}\n{row['input']}"}],
                        max_tokens=3,
                        metadata={"expected_skill": "sst-2"},
                    )
                client.chat.completions.create(
                    model="auto", messages=[{"role": "user", "content": "Write a haiku about Rust."}], max_tokens=3
                )
            empty, errors = [], []
            for title, expr in panel_queries():
                r = httpx.get(f"{api}/query", params={"query": expr}, timeout=30).json()
                if r["status"] != "success":
                    errors.append((title, expr, r.get("error")))
                elif not r["data"]["result"]:
                    empty.append((title, expr))
            assert not errors, errors
            assert not empty, empty
            groups = httpx.get(f"{api}/rules", timeout=30).json()["data"]["groups"]
            rules = [rule for g in groups for rule in g["rules"]]
            names = re.findall(r"- alert: (\S+)", (DEPLOY / "prometheus" / "alerts.yml").read_text())
            assert sorted(r["name"] for r in rules) == sorted(names)
            assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        finally:
            prom.terminate()
            prom.wait(timeout=30)
            log.close()
