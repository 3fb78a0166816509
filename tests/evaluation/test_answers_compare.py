"""`eval answers-compare`: two `eval answers` runs cell by cell, after − before with paired intervals, a cell
`lower` only when its whole interval is below zero, and runs on different rows refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from skillpool.cli.main import main
from skillpool.evaluation.answers_compare import compare, markdown_table


def _run(scores: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, Any]:
    """An `eval answers` JSON with only what the comparison reads."""
    tasks = sorted({t for by_v in scores.values() for by_t in by_v.values() for t in by_t})
    n = {t: len(next(by_t[t] for by_v in scores.values() for by_t in by_v.values() if t in by_t)) for t in tasks}
    return {"tasks": tasks, "n_test": n, "row_scores": scores}


HIT, MISS = 100.0, 0.0


def test_a_clear_loss_is_lower_and_a_gain_or_a_tie_is_not() -> None:
    before = _run(
        {
            "auto": {
                "uploaded": {"a": [HIT] * 90 + [MISS] * 10, "b": [HIT] * 50 + [MISS] * 50},
                "paraphrase": {"a": [HIT] * 40 + [MISS] * 60, "b": [HIT] * 50 + [MISS] * 50},
            }
        }
    )
    after = _run(
        {
            "auto": {
                # a: 30 answers lost with the uploaded instruction; b: unchanged
                "uploaded": {"a": [HIT] * 60 + [MISS] * 40, "b": [HIT] * 50 + [MISS] * 50},
                # a: 40 more right under paraphrase
                "paraphrase": {"a": [HIT] * 80 + [MISS] * 20, "b": [HIT] * 50 + [MISS] * 50},
            }
        }
    )
    out = compare(before, after)
    up, para = out["cells"]["auto"]["uploaded"], out["cells"]["auto"]["paraphrase"]
    assert up["per_task"]["a"]["diff"] == -30.0 and up["per_task"]["a"]["lower"]
    assert up["per_task"]["a"]["ci95"][1] < 0
    assert up["per_task"]["b"] == {"before": 50.0, "after": 50.0, "diff": 0.0, "ci95": [0.0, 0.0], "lower": False}
    assert para["per_task"]["a"]["diff"] == 40.0 and not para["per_task"]["a"]["lower"]
    assert para["per_task"]["a"]["ci95"][0] > 0
    assert up["mean"]["diff"] == -15.0 and up["mean"]["before"] == 70.0 and up["mean"]["after"] == 55.0
    assert out["lower"] == ["auto uploaded a"]
    table = markdown_table(out)
    assert "| a | auto | uploaded | 90.0 | 60.0 | -30.0 [" in table and "(lower)" in table
    assert table.rstrip().endswith("lower: auto uploaded a")


def test_a_small_loss_within_the_noise_is_not_lower() -> None:
    before = _run({"forced": {"uploaded": {"a": [HIT] * 60 + [MISS] * 40}}})
    after = _run({"forced": {"uploaded": {"a": [HIT] * 58 + [MISS] * 42}}})
    cell = compare(before, after)["cells"]["forced"]["uploaded"]["per_task"]["a"]
    # two rows of 100 lost: the interval reaches no further than 0 on top, so it does not lie below zero
    assert cell["diff"] == -2.0 and cell["ci95"][0] < 0 <= cell["ci95"][1]
    assert not cell["lower"]


def test_only_what_both_runs_asked_is_compared() -> None:
    before = _run({"auto": {"uploaded": {"a": [HIT]}}, "base": {"uploaded": {"a": [MISS]}}})
    after = _run({"auto": {"uploaded": {"a": [MISS]}, "system": {"a": [HIT]}}})
    out = compare(before, after)
    assert list(out["cells"]) == ["auto"] and list(out["cells"]["auto"]) == ["uploaded"]


def test_runs_on_different_rows_are_refused() -> None:
    before = _run({"auto": {"uploaded": {"a": [HIT] * 10}}})
    after = _run({"auto": {"uploaded": {"a": [HIT] * 12}}})
    with pytest.raises(SystemExit, match="a: 10 test rows before, 12 after: not paired"):
        compare(before, after)
    with pytest.raises(SystemExit, match="the two runs share no task"):
        compare(before, _run({"auto": {"uploaded": {"z": [HIT]}}}))


def test_the_command_reads_two_runs_and_writes_both_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "b.json").write_text(json.dumps(_run({"auto": {"uploaded": {"a": [HIT, MISS]}}})))
    (tmp_path / "a.json").write_text(json.dumps(_run({"auto": {"uploaded": {"a": [HIT, HIT]}}})))
    out_json, out_md = tmp_path / "cmp" / "c.json", tmp_path / "cmp" / "c.md"
    args = ["eval", "answers-compare", str(tmp_path / "b.json"), str(tmp_path / "a.json")]
    assert main([*args, "--json", str(out_json), "--markdown", str(out_md)]) == 0
    assert json.loads(out_json.read_text())["cells"]["auto"]["uploaded"]["per_task"]["a"]["diff"] == 50.0
    assert out_md.read_text() in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="not an `eval answers` JSON"):
        main(["eval", "answers-compare", str(tmp_path / "bad.json"), str(tmp_path / "a.json")])
