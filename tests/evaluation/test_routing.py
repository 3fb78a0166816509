"""`skillpool eval routing` on a small slice of real tasks: table, JSON and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skillpool.cli.main import main
from tests.datasets import dataset_dir


@pytest.mark.parametrize("mode", ["centroid", "dtkr", "sapt"])
def test_eval_routing_cli_writes_json_and_plots(mode: str, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    tasks = [str(dataset_dir("long_sequence", t)) for t in ("agnews", "sst-2", "boolqa")]
    out = tmp_path / "r.json"
    rc = main(
        [
            "eval",
            "routing",
            "--tasks",
            *tasks,
            "--router",
            mode,
            "--text",
            "with-instruction",
            "--train-limit",
            "60",
            "--test-limit",
            "20",
            "--json",
            str(out),
            "--plots",
            str(tmp_path / "plots"),
            "--replay-fraction",
            "0.1",
        ]
    )  # sapt: 6 replay inputs per task, as 2% of 300 would be
    assert rc == 0
    res = json.loads(out.read_text())
    f = res["final"]
    assert set(f) >= {"top1", "fallback_seen", "fallback_unseen", "per_task"}
    assert list(f["per_task"]) == ["agnews", "sst-2", "boolqa"]
    assert f["top1"] >= 0.8 and f["fallback_seen"] <= 0.2  # small slices; quality is measured by the CLI itself
    assert [s["tasks_seen"] for s in res["steps"]] == [1, 2, 3]
    assert res["steps"][0]["fallback_unseen"] is not None and res["steps"][-1]["fallback_unseen"] is None
    first = res["steps"][0]["per_task"]  # agnews alone: the other two tasks lack its instruction text
    assert all(0 <= v["fallback_format"] <= v.get("fallback", v.get("fallback_unseen")) for v in first.values())
    assert first["sst-2"]["fallback_unseen"] >= 0.9
    assert sum(map(sum, res["confusion"]["counts"])) == 60
    for png in ("routing_confusion.png", "routing_curve.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    assert "final: top1" in capsys.readouterr().out


def test_missing_task_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        main(["eval", "routing", "--tasks", str(tmp_path), "--json", str(tmp_path / "x.json")])
