"""`skillpool eval answers` on the tiny model: a real server process, real uploads, every wording, real HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skillpool.cli.main import main
from tests.datasets import dataset_dir

TASKS = ("task363_sst2_polarity_classification", "task1687_sentiment140_classification")


def _args(tmp: Path, *extra: str) -> list[str]:
    return [
        "eval",
        "answers",
        "--tasks",
        *(str(dataset_dir("superni", t)) for t in TASKS),
        "--instructions",
        "superni",  # the packaged set
        "--json",
        str(tmp / "a.json"),
        *extra,
    ]


@pytest.mark.slow  # one server process, two short trainings on the tiny model, 2 x 4 x 3 x 6 requests, twice: 30-80 s on 2 shared cores
def test_every_route_and_wording_is_scored_with_intervals_and_the_table(tiny_base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    extra = ["--train-limit", "16", "--test-limit", "6", "--model", str(tiny_base.path), "--force"]
    extra += ["--config", json.dumps({"epochs": 1, "max_seq_len": 192}), "--max-new-tokens", "4"]
    extra += [
        "--routes",
        "base,auto,forced",
        "--data-dir",
        str(tmp_path / "data"),
        "--markdown",
        str(tmp_path / "a.md"),
        "--max-task-gap",
        "5",
    ]
    assert main(_args(tmp_path, *extra)) == 0
    r = json.loads((tmp_path / "a.json").read_text())
    assert r["tasks"] == list(TASKS) and r["routes"] == ["forced", "auto", "base"]
    assert r["variants"] == ["uploaded", "paraphrase", "system", "input-only"]
    assert r["metrics"] == dict.fromkeys(TASKS, "exact_match")
    for route in r["routes"]:
        for variant in r["variants"]:
            for t in TASKS:
                rows = r["row_scores"][route][variant][t]
                assert len(rows) == 6 and set(rows) <= {0.0, 100.0}
                said = r["answers"][route][variant][t]
                assert len(said) == 6 and all(isinstance(a, str) for a in said)
                cell = r["scores"][route][variant]["per_task"][t]
                assert cell["ci95"][0] <= cell["score"] <= cell["ci95"][1]
    gap = r["gaps"]["auto"]["paraphrase"]
    for t in TASKS:  # the gap is the difference of the two scores the table shows
        para, upl = (r["scores"]["auto"][v]["per_task"][t]["score"] for v in ("paraphrase", "uploaded"))
        assert gap["per_task"][t]["diff"] == pytest.approx(para - upl, abs=0.02)
    assert set(r["routed_to_own_skill"]) == set(r["variants"])
    assert all(0 <= v <= 100 for by in r["routed_to_own_skill"].values() for v in by.values())
    crit = r["paraphrase_gap"]
    assert isinstance(crit["met"], bool) and (crit["max_task_gap"], crit["max_mean_gap"]) == (5.0, 1.5)
    assert r["config"]["instructions"] == ["superni"]
    assert [j["status"] for j in r["jobs"]] == ["succeeded", "succeeded"]
    table = (tmp_path / "a.md").read_text()
    assert table.count("\n| task363") == 3 and "| **mean** | base |" in table
    # asked again on the same data dir, the skills are kept, not trained again: the same answers
    assert main(_args(tmp_path, *extra, "--reuse")) == 0
    again = json.loads((tmp_path / "a.json").read_text())
    assert [j["finished_at"] for j in again["jobs"]] == [j["finished_at"] for j in r["jobs"]]
    assert again["row_scores"] == r["row_scores"]


def test_bad_arguments_are_refused_before_a_server_starts(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--variants: pick from"):
        main(_args(tmp_path, "--variants", "uploaded,shouted"))
    with pytest.raises(SystemExit, match="--routes: pick from"):
        main(_args(tmp_path, "--routes", ""))
    with pytest.raises(SystemExit, match="--test-limit must be at least 1"):
        main(_args(tmp_path, "--test-limit", "0"))
    with pytest.raises(SystemExit, match="--config"):
        main(_args(tmp_path, "--config", '{"rank": 0}'))
    with pytest.raises(SystemExit, match="--server-args: --port"):
        main(_args(tmp_path, "--server-args=--port 9"))
    with pytest.raises(SystemExit, match="--reuse: give the --data-dir"):
        main(_args(tmp_path, "--reuse"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"task363_sst2_polarity_classification": []}))
    with pytest.raises(SystemExit, match="must be a non-empty list"):
        main([*_args(tmp_path), "--instructions", str(bad)])


def test_the_paraphrase_variant_needs_a_paraphrase_for_every_task(tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"task363_sst2_polarity_classification": ["Positive or negative?"]}))
    with pytest.raises(SystemExit, match="no paraphrases for task1687_sentiment140_classification"):
        main([*_args(tmp_path), "--instructions", str(other), "--train-limit", "4", "--test-limit", "2"])


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--instructions", "superni_v2", "neither a packaged paraphrase set (long_sequence, superni) nor a JSON file"),
        ("--max-task-gap", "-0.5", "--max-task-gap: must be at least 0, not -0.5"),
        ("--max-mean-gap", "nan", "--max-mean-gap: must be finite, not nan"),
        ("--max-mean-gap", "much", "--max-mean-gap: not a number: 'much'"),
    ],
)
def test_an_unknown_paraphrase_set_or_a_bad_gap_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str
) -> None:
    argv = ["eval", "answers", "--tasks", str(tmp_path), "--json", str(tmp_path / "a.json"), flag, value]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and says in capsys.readouterr().err
