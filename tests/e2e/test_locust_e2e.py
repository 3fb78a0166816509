"""The Locust file in load_tests/ runs headless against a live server (tiny LLaMA, in-process trainer) for a
bounded time: chat (routed and streamed), model listing and a trickle of uploads, with no failures."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skillpool.evaluation.process import ServerProcess
from skillpool.evaluation.tasks import DATASETS_SETTING
from tests.datasets import dataset_dir

pytestmark = pytest.mark.slow
LOCUSTFILE = Path(__file__).resolve().parents[2] / "load_tests" / "serving" / "locustfile.py"


def test_locust_headless_run_has_no_failures(tiny_base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # skips with a message naming SKILLPOOL_DATASETS when unset; locust reads the same setting
    datasets = dataset_dir("long_sequence", "sst-2").parent.parent
    with ServerProcess(tmp_path / "data", ["--model", str(tiny_base.path), "--default-max-tokens", "4"]) as srv:
        run = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", srv.url, "--headless"]
            + ["-u", "5", "-r", "5", "-t", "20s", "--csv", str(tmp_path / "run"), "--only-summary"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, DATASETS_SETTING: str(datasets)},
        )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["Name"]: r for r in csv.DictReader((tmp_path / "run_stats.csv").open())}
    assert int(rows["Aggregated"]["Failure Count"]) == 0, rows["Aggregated"]
    for name in ("chat auto", "chat stream", "models", "upload"):
        assert int(rows[name]["Request Count"]) > 0, (name, rows.get(name))
