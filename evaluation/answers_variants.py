"""The requests `eval answers` sends for one test row: the same input under four wordings of the task.

uploaded     the row's own instruction and input in one user turn, as the skill was trained (trainer.datasets)
paraphrase   a hand-written paraphrase of the instruction instead (row i gets paraphrase i mod n; '{input}' in it
             marks where the input goes, else the input follows it on its own line)
system       the row's own instruction as a system message, the input as the user turn
input-only   the input alone, no instruction
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from skillpool.trainer.records import Example

from .continual_task import Task

VARIANTS = ("uploaded", "paraphrase", "system", "input-only")
INPUT = "{input}"


def messages_for(row: dict[str, Any], variant: str, paraphrase: str | None = None) -> list[dict[str, str]]:
    """The chat messages of one test row under `variant` (paraphrase: the instruction that replaces the row's)."""
    instruction, inp = str(row.get("instruction", "")), str(row.get("input", ""))
    if variant == "uploaded":
        return [{"role": "user", "content": "\n".join(p for p in (instruction, inp) if p)}]
    if variant == "paraphrase":
        if not paraphrase:
            raise ValueError("the paraphrase variant needs a paraphrase")
        text = paraphrase.replace(INPUT, inp) if INPUT in paraphrase else "\n".join(p for p in (paraphrase, inp) if p)
        return [{"role": "user", "content": text}]
    if variant == "system":
        if not instruction:
            raise ValueError("the system variant needs a row with an instruction")
        return [{"role": "system", "content": instruction}, {"role": "user", "content": inp or instruction}]
    if variant == "input-only":
        return [{"role": "user", "content": inp or instruction}]  # a row without input is its instruction alone
    raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")


@dataclass
class AnswerTask:
    """A task as `eval answers` sees it: the continual task (upload body, budget, metric) and its raw test rows."""

    task: Task
    rows: list[dict[str, Any]]  # the test rows as read (instruction and input apart), in the order of task.test
    paraphrases: list[str]

    @property
    def name(self) -> str:
        return self.task.name

    def variant(self, variant: str) -> Task:
        """The task with every test row asked under `variant`: same answers, budget and metric."""
        if variant == "paraphrase" and not self.paraphrases:
            raise ValueError(f"{self.name}: no paraphrases")
        test: list[Example] = []
        for i, (row, ex) in enumerate(zip(self.rows, self.task.test, strict=True)):
            para = self.paraphrases[i % len(self.paraphrases)] if variant == "paraphrase" else None
            test.append({**ex, "messages": messages_for(row, variant, para)})
        return replace(self.task, test=test)
