"""The monitoring files in deploy/ hold together: the alert rules and the Prometheus config parse, each alert
fires on the series made for it and stays silent on a healthy one (promtool's rule unit tests,
deploy/prometheus/alerts_test.yml), every alert names the dashboard panel that charts its subject, every panel
query is valid PromQL once Grafana's variables are filled in, and the Alertmanager config loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.test_prometheus_e2e import panel_queries

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROM = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "skillpool.json"
# the series every training panel and alert reads: one query must see in-process trainers and Redis workers
TRAINING = re.compile(r"skillpool_(training_\w+|trainer_up)")


def tool(name: str) -> str:
    found = shutil.which(name)
    assert found, f"{name} is missing: apt-get install prometheus prometheus-alertmanager (.ci/run installs them)"
    return found


def run(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=120)


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def metrics_in(promql: str) -> set[str]:
    return set(re.findall(r"skillpool_[a-z0-9_]+", promql)) | ({"up"} if re.search(r"\bup\{", promql) else set())


def test_rules_and_config_parse() -> None:
    promtool = tool("promtool")
    checked = run(promtool, "check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout, checked.stdout
    config = run(promtool, "check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr
    scraped = {job["job_name"] for job in yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]}
    assert {"skillpool", "skillpool-worker"} <= scraped  # the jobs the dashboard and the alerts name


def test_the_server_job_scrapes_with_the_metrics_key_compose_gives_both() -> None:
    """With keys, /metrics needs a key of role metrics: Prometheus' job sends the file compose mounts beside its
    config, and compose hands the server its key (the same secret, SKILLPOOL_METRICS_KEY)."""
    jobs = {job["job_name"]: job for job in yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]}
    auth = jobs["skillpool"]["authorization"]
    assert auth["type"] == "Bearer" and (PROM / auth["credentials_file"]).is_file()
    assert (PROM / auth["credentials_file"]).read_text().strip() == ""  # shipped without a secret
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    assert (
        f"./prometheus/{auth['credentials_file']}:/etc/prometheus/{auth['credentials_file']}:ro"
        in (compose["prometheus"]["volumes"])
    )
    assert "SKILLPOOL_METRICS_KEY" in compose["skillpool"]["environment"]
    monitor = next(yaml.safe_load_all((DEPLOY / "k8s" / "servicemonitor.yaml").read_text()))
    secret = monitor["spec"]["endpoints"][0]["authorization"]["credentials"]
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SKILLPOOL_METRICS_KEY"]["valueFrom"]["secretKeyRef"] | {"optional": True} == {
        **secret,
        "optional": True,
    }


def test_every_alert_fires_on_its_series_and_only_then() -> None:
    result = run(tool("promtool"), "test", "rules", "alerts_test.yml")
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    cases: dict[str, list[bool]] = {}
    for test in yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(bool(case["exp_alerts"]))
    names = [rule["alert"] for rule in rules()]
    assert len(names) == 10, names
    # each alert has a case where it fires and one where it must not
    assert {name: sorted(set(cases.get(name, []))) for name in names} == {name: [False, True] for name in names}


def test_every_alert_names_the_panel_that_charts_its_subject() -> None:
    """An operator paged by an alert opens the panel its `panel` annotation names: it must exist and query at
    least one series the alert reads."""
    by_title: dict[str, set[str]] = {}
    for panel in panels():
        by_title.setdefault(panel["title"], set()).update(
            *(metrics_in(target.get("expr", "")) for target in panel.get("targets", []))
        )
    for rule in rules():
        title = rule["annotations"].get("panel")
        assert title in by_title, (rule["alert"], title)
        assert metrics_in(rule["expr"]) & by_title[title], (rule["alert"], title, metrics_in(rule["expr"]))


def test_every_panel_query_is_promql_once_grafana_fills_it_in(tmp_path: Path) -> None:
    """promtool parses each query (filled in as the end-to-end test sends it) as a recording rule."""
    queries = [q[1] for q in panel_queries()]
    assert len(queries) >= len(panels())  # every panel has a query
    group = {"name": "panels", "rules": [{"record": f"panel:query_{i}", "expr": q} for i, q in enumerate(queries)]}
    (tmp_path / "panels.yml").write_text(yaml.safe_dump({"groups": [group]}))
    checked = run(tool("promtool"), "check", "rules", "panels.yml", cwd=tmp_path)
    assert checked.returncode == 0 and f"SUCCESS: {len(queries)} rules found" in checked.stdout, (
        checked.stdout + checked.stderr
    )


def test_dashboard_layout_and_aggregation() -> None:
    """Unique panel ids on a non-overlapping grid; training queries see both layouts (no job or instance
    filter); the shared queue's gauges, which every server and worker reports whole, are taken with max, and so
    are the adapter tiers per replica, which every ingress of a cluster reports."""
    every = json.loads(DASHBOARD.read_text())["panels"]
    assert len({p["id"] for p in every}) == len(every)
    cells = [(x, y) for p in every for g in [p["gridPos"]] for x in range(g["x"], g["x"] + g["w"])
             for y in range(g["y"], g["y"] + g["h"])]  # fmt: skip
    assert len(cells) == len(set(cells)), "panels overlap"
    for panel in panels():
        for target in panel.get("targets", []):
            expr = target["expr"]
            if TRAINING.search(expr):
                assert "$instance" not in expr and "job=" not in expr, (panel["title"], expr)
            for gauge in re.findall(r"(\w*)\s*\(\s*skillpool_training_jobs_(?:queued|running)\b", expr):
                assert gauge == "max", (panel["title"], expr)
            if re.search(r"\bsum\b.*skillpool_adapter_(?:hits|loads)_total", expr):
                assert expr.count("max by (tier, replica)") == expr.count("skillpool_adapter_"), (panel["title"], expr)
    titles = {p["title"] for p in panels()}
    assert {
        "Engine health",
        "Scrape targets up",
        "Fallback clusters",
        "Trainer up",
        "Resident skills and adapter loads",
        "Adapter hit ratio per tier",
        "Training progress",
        "Training jobs queued and running",
    } <= titles


def test_alertmanager_config_loads() -> None:
    checked = run(tool("amtool"), "check-config", "alertmanager.yml", cwd=DEPLOY / "alertmanager")
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    targets = yaml.safe_load((PROM / "prometheus.yml").read_text())["alerting"]["alertmanagers"][0]
    assert targets["static_configs"][0]["targets"] == ["alertmanager:9093"]
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    assert "9093:9093" in compose["alertmanager"]["ports"]


def test_dashboard_and_rules_name_only_metrics_the_code_exports() -> None:
    """A renamed metric would leave a panel or an alert silently empty: every skillpool_* series they query
    must be one the server's registry (training series included, as a worker exports them) can produce."""
    from skillpool.server.metrics import Metrics

    metrics, exported = Metrics(), set()
    # registered families, and the catalog for those read from the engine and the job queue at scrape time
    for name in [family.name for family in metrics.registry.collect()] + list(metrics.catalog):
        exported |= {name + suffix for suffix in ("", "_total", "_bucket", "_sum", "_count")}
    used = set(re.findall(r"skillpool_[a-z0-9_]+", DASHBOARD.read_text() + (PROM / "alerts.yml").read_text()))
    assert used and used <= exported, sorted(used - exported)
