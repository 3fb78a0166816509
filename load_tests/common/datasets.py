"""The benchmark datasets as the load and acceptance scripts read them: rows from the folder SKILLPOOL_DATASETS
names, and a chat user's text for a row. A script whose data is missing stops, naming the setting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from skillpool.evaluation.tasks import DATASETS_SETTING, dataset_folder, datasets_root, task_lines, task_text


def datasets() -> Path:
    """The benchmark datasets folder SKILLPOOL_DATASETS names; stops the script with that message when unset."""
    root = datasets_root()
    if root is None:
        raise SystemExit(f"{DATASETS_SETTING} is not set: point it at the benchmark datasets folder (GROUP/TASK/)")
    return root


def rows(group: str, task: str, split: str, n: int | None = None) -> list[dict[str, Any]]:
    """The first n rows (all: None) of GROUP/TASK/SPLIT.jsonl under SKILLPOOL_DATASETS; stops the script when the
    setting or the task is missing."""
    try:
        folder = dataset_folder(group, task)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    lines = task_lines(folder, split)
    return [json.loads(x) for x in (lines[:n] if n else lines)]


def user_text(row: dict[str, Any]) -> str:
    """What a chat user sends for a benchmark row: instruction + input, as the router is evaluated."""
    return task_text(row, "with-instruction")
