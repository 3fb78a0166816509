"""`skillpool eval continual` baselines, trained in this process on the same backbone, split and
hyperparameters as the server's skills: `seq` (one LoRA on the tasks in turn), `mtl` (one LoRA on all
tasks jointly) and single-task references (each task alone, for FWT)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skillpool.adapters_store.base_model import resolve_device
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.heap import release_freed_memory

from .continual_metrics import row_mean

if TYPE_CHECKING:
    from skillpool.trainer.records import Example

    from .continual import Task


class Baselines:
    """seq, mtl and single-task references on the same backbone, split and hyperparameters."""

    def __init__(self, model_path: Path, cfg: TrainConfig) -> None:
        from transformers import AutoTokenizer

        self.path, self.cfg = model_path, cfg
        self.tok = AutoTokenizer.from_pretrained(str(model_path))
        self.tokens, self.train_s = 0, 0.0

    def _fresh(self) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        from skillpool.trainer.lora_train import add_lora

        model = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=torch.float32)
        peft_model = add_lora(
            model, self.cfg.rank, self.cfg.alpha, self.cfg.dropout, self.cfg.target_modules, self.cfg.seed
        )
        return peft_model.to(resolve_device())  # the device the server's trainer picks

    def _fit(self, peft_model: Any, examples: list[Example], label: str) -> None:
        from tqdm import tqdm

        from skillpool.trainer.loop import Progress
        from skillpool.trainer.lora_train import fit_config

        bar = tqdm(desc=label, unit="step", dynamic_ncols=True)
        last = [0]

        def progress(p: Progress) -> None:
            bar.total, bar.n = p.total, p.step
            bar.set_postfix(loss=f"{p.loss or 0:.3f}", tok_s=f"{p.tokens_per_s:.0f}")
            last[0] = p.tokens

        t0 = time.perf_counter()
        try:
            fit_config(peft_model, self.tok, examples, self.cfg, progress)
        finally:
            bar.close()
            release_freed_memory()
        self.train_s += time.perf_counter() - t0
        self.tokens += last[0]

    def row_scores(self, peft_model: Any, task: Task) -> list[float]:
        from skillpool.trainer.scoring import generate_greedy

        return task.row_scores(generate_greedy(peft_model, self.tok, [e["messages"] for e in task.test], task.budget))

    def seq(self, tasks: list[Task]) -> tuple[list[list[float | None]], list[list[float]], list[list[float]]]:
        """One LoRA trained on the tasks in turn: its score matrix, its final row's per-row scores and its
        diagonal's (each task's rows right after it was learned, for FWT's interval)."""
        model = self._fresh()
        matrix: list[list[float | None]] = [[None] * len(tasks) for _ in tasks]
        final: list[list[float]] = []
        diagonal: list[list[float]] = []
        for j, task in enumerate(tasks):
            self._fit(model, task.train, f"seq [{j + 1}/{len(tasks)}] {task.name}")
            final = [self.row_scores(model, tasks[i]) for i in range(j + 1)]
            diagonal.append(final[j])
            for i, rows in enumerate(final):
                matrix[j][i] = row_mean(rows)
        return matrix, final, diagonal

    def mtl(self, tasks: list[Task]) -> list[list[float]]:
        """Per-row scores on every task of one LoRA trained on all of them jointly."""
        import random

        joint = [e for t in tasks for e in t.train]
        random.Random(self.cfg.seed).shuffle(joint)
        model = self._fresh()
        self._fit(model, joint, f"mtl ({len(tasks)} tasks)")
        return [self.row_scores(model, t) for t in tasks]

    def single(self, tasks: list[Task]) -> list[list[float]]:
        """Per-row scores of each task trained alone on the base model."""
        out = []
        for task in tasks:
            model = self._fresh()
            self._fit(model, task.train, f"single {task.name}")
            out.append(self.row_scores(model, task))
        return out
