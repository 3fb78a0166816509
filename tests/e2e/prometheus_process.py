"""A real Prometheus (Debian's `prometheus` binary) for end-to-end tests: its own free port and temp storage,
1 s scrapes of the given jobs under deploy/'s job names, each with the credentials deploy/ gives it (a job's
`authorization` block, its file holding the test's key), deploy/'s alert rules, and its HTTP API."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from skillpool.evaluation.process import free_port
from tests.conftest import until

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


class Prometheus:
    """`with Prometheus(folder, {"skillpool": [port]}) as prom:` scrapes 127.0.0.1:port every second."""

    def __init__(self, folder: Path, jobs: dict[str, list[int]], tokens: dict[str, str] | None = None) -> None:
        """`tokens`: job -> the bearer token its targets take, written where the job's deployed config reads it."""
        config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        self.deployed = {job["job_name"]: job for job in config["scrape_configs"]}
        missing = set(jobs) - set(self.deployed)
        assert not missing, f"deploy/prometheus/prometheus.yml has no scrape job {missing}"
        self.folder, self.jobs, self.port, self.tokens = folder, jobs, free_port(), tokens or {}
        self.api = f"http://127.0.0.1:{self.port}/api/v1"
        self.proc: subprocess.Popen[bytes] | None = None
        self._types: dict[str, str] | None = None

    def __enter__(self) -> Prometheus:
        exe = shutil.which("prometheus")
        assert exe, "prometheus is missing: apt-get install prometheus (.ci/run installs it)"
        config = self.folder / "prometheus.yml"
        lines = [
            "global: {scrape_interval: 1s, evaluation_interval: 1s}",
            f"rule_files: ['{DEPLOY / 'prometheus' / 'alerts.yml'}']",
            "scrape_configs:",
        ]
        for job, ports in self.jobs.items():
            targets = ", ".join(f"'127.0.0.1:{p}'" for p in ports)
            auth = ""
            if job in self.tokens:  # the deployed job's authorization, its file holding the token
                deployed = self.deployed[job].get("authorization")
                assert deployed and deployed.get("credentials_file"), f"deploy/'s job {job} sends no credentials"
                secret = self.folder / f"{job}-{Path(deployed['credentials_file']).name}"
                secret.write_text(self.tokens[job])
                auth = f", authorization: {{type: {deployed['type']}, credentials_file: '{secret}'}}"
            lines.append(f"  - {{job_name: {job}, static_configs: [{{targets: [{targets}]}}]{auth}}}")
        config.write_text("\n".join(lines) + "\n")
        with (self.folder / "prometheus.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    exe,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.folder / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        until(self._ready, timeout=60)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log_tail()
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, n: int = 3000) -> str:
        return (self.folder / "prometheus.log").read_text(errors="replace")[-n:]

    def _get(self, path: str, **params: Any) -> Any:
        body = httpx.get(f"{self.api}/{path}", params=params, timeout=30).json()
        assert body["status"] == "success", body.get("error")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query now: the series in the latest scrape (a series its target stopped exporting is gone)."""
        return list(self._get("query", query=expr)["result"])

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict[str, Any]]:
        return list(self._get("query_range", query=expr, start=start, end=end, step=step_s)["result"])

    def scraped_since(self, t: float) -> bool:
        """Whether every target's latest scrape started after `t` (a Unix time)."""
        jobs = "|".join(self.jobs)
        latest = self.query(f'timestamp(up{{job=~"{jobs}"}})')
        return len(latest) == sum(len(p) for p in self.jobs.values()) and all(float(r["value"][1]) > t for r in latest)

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self._get("rules")["groups"] for rule in group["rules"]]

    def metric_type(self, name: str) -> str:
        """A series' metric type from the scraped metadata (counter, gauge, histogram, ...); a counter's or a
        histogram's `_created` timestamp (which prometheus_client types as a gauge) is of its family's type."""
        if self._types is None:
            meta = self._get("metadata")
            self._types = {family: entries[0]["type"] for family, entries in meta.items()}
        base = re.sub(r"_(bucket|sum|count|total|created)$", "", name)
        for family in (base + "_total", base) if name.endswith("_created") else (name, base):
            if family in self._types:
                return self._types[family]
        return "unknown"
