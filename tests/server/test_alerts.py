"""The alert rules in deploy/prometheus parse, and each fires on the series made for it and stays silent on
a healthy one (promtool's own rule unit tests, deploy/prometheus/alerts_test.yml)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PROM = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: apt-get install prometheus (.ci/run installs it)"
    return found


def run(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], cwd=PROM, capture_output=True, text=True, timeout=120)


def test_rules_and_config_parse(promtool: str) -> None:
    rules = run(promtool, "check", "rules", "alerts.yml")
    assert rules.returncode == 0 and "SUCCESS: 7 rules found" in rules.stdout, rules.stdout + rules.stderr
    config = run(promtool, "check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr


def test_every_alert_fires_on_its_series_and_only_then(promtool: str) -> None:
    result = run(promtool, "test", "rules", "alerts_test.yml")
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    tested = (PROM / "alerts_test.yml").read_text()
    rules = (PROM / "alerts.yml").read_text()
    alerts = [line.split(":", 1)[1].strip() for line in rules.splitlines() if line.strip().startswith("- alert:")]
    assert len(alerts) == 7 and all(f"alertname: {a}" in tested for a in alerts)  # none left untested


def test_dashboard_and_rules_name_only_metrics_the_server_exports() -> None:
    """A renamed metric would leave a panel or an alert silently empty: every skillpool_* series they query
    must be one the server's registry can produce."""
    import re

    from skillpool.server.metrics import Metrics

    exported: set[str] = set()
    for family in Metrics().registry.collect():
        exported |= {family.name + suffix for suffix in ("", "_total", "_bucket", "_sum", "_count")}
    dashboard = (PROM.parent / "grafana" / "dashboards" / "skillpool.json").read_text()
    rules = (PROM / "alerts.yml").read_text()
    used = set(re.findall(r"skillpool_[a-z0-9_]+", dashboard + rules))
    assert used and used <= exported, sorted(used - exported)
