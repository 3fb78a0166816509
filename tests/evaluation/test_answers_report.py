"""`eval answers`' numbers: scores with bootstrap intervals, paired gaps, the paraphrase-gap criterion and the
table."""

from __future__ import annotations

import pytest

from skillpool.evaluation.answers_report import GapCriterion, markdown_table, summarize, within_criterion


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
    assert out["paraphrase_gap"] == {
        "max_task_gap": 3.0,
        "max_mean_gap": 1.5,
        "rule": out["paraphrase_gap"]["rule"],
        "tasks_failing": ["t"],
        "mean_gap_ok": False,
        "met": False,
    }


def test_the_criterion_passes_small_gaps_and_gaps_whose_interval_reaches_minus_three() -> None:
    assert within_criterion(-2.9, (-6.0, 0.0)) and within_criterion(5.0, (2.0, 8.0))
    assert within_criterion(-5.0, (-9.0, -2.0))  # -3 is inside the interval: not ruled out
    assert not within_criterion(-5.0, (-8.0, -3.5))
    assert within_criterion(-5.0, (-8.0, -5.5), limit=6.0)  # a looser threshold
    same = [100.0, 0.0] * 10
    rows = {"auto": {"uploaded": {"x": same, "y": same}, "paraphrase": {"x": same, "y": same}}}
    assert summarize(rows, ["x", "y"])["paraphrase_gap"]["met"] is True


def test_the_thresholds_decide_the_criterion_and_are_recorded_with_it() -> None:
    # 200 rows: x loses 20 answers (-10), y none; x's paired interval stays below -3, the mean gap is -5
    upl = [100.0] * 200
    rows = {"auto": {"uploaded": {"x": upl, "y": upl}, "paraphrase": {"x": [100.0] * 180 + [0.0] * 20, "y": upl}}}
    strict = summarize(rows, ["x", "y"])["paraphrase_gap"]
    assert strict["tasks_failing"] == ["x"] and not strict["mean_gap_ok"] and strict["met"] is False
    loose = summarize(rows, ["x", "y"], GapCriterion(max_task_gap=10.0, max_mean_gap=5.0))["paraphrase_gap"]
    assert (loose["max_task_gap"], loose["max_mean_gap"]) == (10.0, 5.0)
    assert loose["tasks_failing"] == [] and loose["mean_gap_ok"] and loose["met"] is True
    assert "≥ −10" in loose["rule"] and "mean gap ≥ −5" in loose["rule"]


def test_means_and_gaps_over_tasks_and_no_criterion_without_an_auto_paraphrase() -> None:
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
    assert out["paraphrase_gap"] is None


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
    assert "\nparaphrase-gap criterion (auto: " in table and table.rstrip().endswith("not met; mean gap too large")


def test_a_result_written_before_the_criterion_was_named_still_gets_its_line() -> None:
    rows = {"auto": {"uploaded": {"x": [100.0, 100.0]}, "paraphrase": {"x": [100.0, 100.0]}}}
    out = summarize(rows, ["x"])
    old = {"tasks": ["x"], "variants": ["uploaded", "paraphrase"], "routes": ["auto"], **out}
    old["bar"] = {k: v for k, v in old.pop("paraphrase_gap").items() if not k.startswith("max_")}
    assert markdown_table(old).rstrip().endswith("): met")
    assert "paraphrase-gap criterion (auto: each task's paraphrase − uploaded ≥ −3" in markdown_table(old)
