"""`eval answers`' numbers: scores with bootstrap intervals, paired gaps, issue 46's bar and the table."""

from __future__ import annotations

import pytest

from skillpool.evaluation.answers_report import markdown_table, summarize, within_bar


def _rows(upl: list[float], para: list[float]) -> dict[str, list[float]]:
    return {"a": upl, "b": para}


def test_a_paired_gap_is_tighter_than_the_scores_it_compares() -> None:
    # 200 rows: the paraphrase loses 20 answers on a task the skill gets 60% right
    upl = [100.0] * 120 + [0.0] * 80
    para = [100.0] * 100 + [0.0] * 100
    rows = {"auto": {"uploaded": {"t": upl}, "paraphrase": {"t": para}}}
    out = summarize(rows, ["t"])
    gap = out["gaps"]["auto"]["paraphrase"]["per_task"]["t"]
    assert gap["diff"] == pytest.approx(-10.0)
    lo, hi = gap["ci95"]
    assert lo < -10.0 < hi < -3.0  # every draw loses answers, never gains; 200 rows rule -3 out
    s_lo, s_hi = out["scores"]["auto"]["uploaded"]["per_task"]["t"]["ci95"]
    assert hi - lo < s_hi - s_lo  # pairing removes the rows both sides get right or wrong
    assert out["bar"] == {
        "rule": out["bar"]["rule"],
        "tasks_failing": ["t"],
        "mean_gap_ok": False,
        "met": False,
    }


def test_the_bar_passes_small_gaps_and_gaps_whose_interval_reaches_minus_three() -> None:
    assert within_bar(-2.9, (-6.0, 0.0)) and within_bar(5.0, (2.0, 8.0))
    assert within_bar(-5.0, (-9.0, -2.0))  # -3 is inside the interval: not ruled out
    assert not within_bar(-5.0, (-8.0, -3.5))
    same = [100.0, 0.0] * 10
    rows = {"auto": {"uploaded": {"x": same, "y": same}, "paraphrase": {"x": same, "y": same}}}
    assert summarize(rows, ["x", "y"])["bar"]["met"] is True


def test_means_and_gaps_over_tasks_and_no_bar_without_an_auto_paraphrase() -> None:
    rows = {
        "forced": {
            "uploaded": {"x": [100.0, 100.0], "y": [0.0, 100.0]},
            "system": {"x": [100.0, 0.0], "y": [0.0, 0.0]},
        }
    }
    out = summarize(rows, ["x", "y"])
    assert out["scores"]["forced"]["uploaded"]["mean"] == 75.0
    assert out["scores"]["forced"]["system"]["per_task"]["x"]["score"] == 50.0
    assert out["gaps"]["forced"]["system"]["mean"] == -50.0  # (-50 + -50) / 2
    assert out["bar"] is None


def test_the_table_has_a_row_per_task_and_route_and_the_gap_column() -> None:
    rows = {route: {"uploaded": {"x": [100.0, 0.0]}, "paraphrase": {"x": [0.0, 0.0]}} for route in ("forced", "auto")}
    result = {
        "tasks": ["x"],
        "variants": ["uploaded", "paraphrase"],
        "routes": ["forced", "auto"],
        "routed_to_own_skill": {"uploaded": {"x": 100.0}, "paraphrase": {"x": 50.0}},
        **summarize(rows, ["x"]),
    }
    table = markdown_table(result)
    lines = table.splitlines()
    assert lines[0] == "| task | route | uploaded | paraphrase | paraphrase − uploaded | routed to own skill % |"
    assert lines[2].startswith("| x | forced | 50.0 [0.0, 100.0] | 0.0 [0.0, 0.0] | -50.0 [")
    assert lines[4].startswith("| x | auto |") and lines[4].endswith("| 100 / 50 |")
    assert lines[5].startswith("| **mean** | auto | 50.0 [")
    # one row in two lost: the paired interval [-100, 0] does not rule -3 out, but the mean gap fails
    assert "bar (" in table and table.rstrip().endswith("not met; mean gap too large")
