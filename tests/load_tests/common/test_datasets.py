"""load_tests/common/datasets.py reads benchmark rows only from the folder SKILLPOOL_DATASETS names, and stops a benchmark
with a message naming the setting when it is unset or lacks the task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load_tests.common.datasets import datasets, rows
from skillpool.evaluation.tasks import DATASETS_SETTING


def test_rows_come_from_the_folder_the_setting_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = tmp_path / "long_sequence" / "agnews"
    task.mkdir(parents=True)
    lines = [{"instruction": "Classify", "input": f"text {i}", "output": "World"} for i in range(3)]
    (task / "test.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    monkeypatch.setenv(DATASETS_SETTING, str(tmp_path))
    assert datasets() == tmp_path
    assert rows("long_sequence", "agnews", "test") == lines
    assert rows("long_sequence", "agnews", "test", 2) == lines[:2]
    with pytest.raises(SystemExit, match="sst-2"):
        rows("long_sequence", "sst-2", "test")


def test_a_benchmark_stops_naming_the_setting_when_it_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATASETS_SETTING, raising=False)
    with pytest.raises(SystemExit, match=DATASETS_SETTING):
        rows("long_sequence", "agnews", "test")
    with pytest.raises(SystemExit, match=DATASETS_SETTING):
        datasets()
