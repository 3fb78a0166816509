"""A task as `eval continual` sees it (its own module: the driver and the baselines both use it)."""

from __future__ import annotations

from dataclasses import dataclass

from skillpool.trainer.records import Example
from skillpool.trainer.scoring import score


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
