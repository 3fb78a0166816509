"""The benchmark datasets as the tests read them: a task's folder, its rows and examples, and a chat user's text
for a row. A test whose data is missing skips with a message naming SKILLPOOL_DATASETS."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from skillpool.evaluation.tasks import dataset_folder, task_lines, task_text


def dataset_dir(group: str, task: str) -> Path:
    """<datasets>/<group>/<task>; skips the test with a message naming SKILLPOOL_DATASETS when it is unset or lacks
    the folder."""
    try:
        return dataset_folder(group, task)
    except ValueError as e:
        pytest.skip(f"benchmark data: {e}")


def read_task(group: str, task: str, split: str, limit: int | None = None) -> list[dict]:
    from skillpool.trainer.datasets import parse_jsonl

    data = (dataset_dir(group, task) / f"{split}.jsonl").read_bytes()
    examples = parse_jsonl(data)
    return examples[:limit] if limit else examples


def sst2_lines(n: int) -> bytes:
    """The first n lines of the shared sst-2 training file, as uploaded."""
    return b"\n".join((dataset_dir("long_sequence", "sst-2") / "train.jsonl").read_bytes().splitlines()[:n])


def rows(group: str, task: str, split: str, n: int | None = None) -> list[dict[str, Any]]:
    """The first n rows (all: None) of GROUP/TASK/SPLIT.jsonl."""
    lines = task_lines(dataset_dir(group, task), split)
    return [json.loads(x) for x in (lines[:n] if n else lines)]


def user_text(row: dict[str, Any]) -> str:
    """What a chat user sends for a benchmark row: instruction + input, as the router is evaluated."""
    return task_text(row, "with-instruction")
