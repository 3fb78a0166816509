"""A task as `eval continual` sees it, and how its folder is read (the driver and the baselines both use it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skillpool.trainer.config import TrainConfig
from skillpool.trainer.datasets import parse_jsonl
from skillpool.trainer.records import Example
from skillpool.trainer.scoring import metric_for, score
from skillpool.trainer.skill_trainer import split_examples

from .tasks import task_lines


@dataclass
class Task:
    """A task as `eval continual` sees it: the uploaded rows and the normalized examples to score."""

    name: str
    train_body: bytes  # the JSONL rows uploaded
    train: list[Example]  # the rows the server trains on (its split), for the in-process baselines
    test: list[Example]
    metric: str
    budget: int = 16  # max new tokens when answering

    def row_scores(self, answers: list[str]) -> list[float]:
        """Each test row's score in points (0-100), by the task's metric."""
        return [100 * score(self.metric, a, e["answer"]) for a, e in zip(answers, self.test, strict=True)]


def _read_rows(folder: Path, split: str, limit: int | None) -> bytes:
    try:
        lines = task_lines(folder, split)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    return "\n".join(lines[:limit] if limit else lines).encode()


def load_tasks(
    folders: list[Path], train_limit: int | None, test_limit: int | None, metric: str, cfg: TrainConfig
) -> list[Task]:
    tasks = []
    for folder in folders:
        body = _read_rows(folder, "train", train_limit)
        examples = parse_jsonl(body)
        test = parse_jsonl(_read_rows(folder, "test", test_limit))
        answers = [e["answer"] for e in examples]
        tasks.append(
            Task(
                folder.name.lower(),
                body,
                split_examples(examples, cfg)[0],
                test,
                metric_for(answers) if metric == "auto" else metric,
            )
        )
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise SystemExit(f"task names must be unique: {names}")
    return tasks


def set_budgets(tasks: list[Task], tokenizer: Any, cap: int) -> None:
    from skillpool.trainer.quality import answer_budget

    for t in tasks:
        t.budget = answer_budget(tokenizer, [e["answer"] for e in t.train], cap)
