"""`skillpool eval continual` baselines, trained on the same backbone, split and hyperparameters as the
server's skills: `seq` (one LoRA on the tasks in turn), `mtl` (one LoRA on all tasks jointly) and single-task
references (each task alone, for FWT). They run after the server's sequence, or with --parallel beside it,
each in a process of its own: on a GPU the sides share it and the run takes about as long as its longest side.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from skillpool.runtime.base_model import resolve_device
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.heap import release_freed_memory

from .continual_metrics import row_mean
from .progress_log import ProgressLog

if TYPE_CHECKING:
    from skillpool.trainer.records import Example

    from .continual_task import Task


class Baselines:
    """seq, mtl and single-task references on the same backbone, split and hyperparameters."""

    def __init__(self, model_path: Path, cfg: TrainConfig, log: ProgressLog | None = None, bars: bool = True) -> None:
        from transformers import AutoTokenizer

        self.path, self.cfg, self.log, self.bars = model_path, cfg, log or ProgressLog(), bars
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

    def _fit(self, peft_model: Any, examples: list[Example], label: str) -> tuple[float, int]:
        """Train `peft_model` on `examples`; its seconds and tokens (also added to the side's totals)."""
        from tqdm import tqdm

        from skillpool.trainer.loop import Progress
        from skillpool.trainer.lora_train import fit_config

        bar = tqdm(desc=label, unit="step", dynamic_ncols=True, disable=not self.bars)
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
        seconds = time.perf_counter() - t0
        self.train_s += seconds
        self.tokens += last[0]
        return seconds, last[0]

    def _scored(self, side: str, after: str, rows: dict[str, list[float]], fit: tuple[float, int]) -> None:
        """Log a measured step with the training it took (`fit`: seconds, tokens), so a resumed run that keeps
        this side still counts its training; and print it: beside the server (--parallel) there are no bars."""
        self.log.scored(side, after, rows, train_s=round(fit[0], 2), train_tokens=fit[1])
        print(f"{side} after {after}: " + "  ".join(f"{n} {row_mean(r):.1f}" for n, r in rows.items()), flush=True)

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
            fit = self._fit(model, task.train, f"seq [{j + 1}/{len(tasks)}] {task.name}")
            final = [self.row_scores(model, tasks[i]) for i in range(j + 1)]
            self._scored("seq", task.name, {tasks[i].name: final[i] for i in range(j + 1)}, fit)
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
        fit = self._fit(model, joint, f"mtl ({len(tasks)} tasks)")
        out = [self.row_scores(model, t) for t in tasks]
        self._scored("mtl", tasks[-1].name, {t.name: r for t, r in zip(tasks, out, strict=True)}, fit)
        return out

    def single(self, tasks: list[Task]) -> list[list[float]]:
        """Per-row scores of each task trained alone on the base model."""
        out = []
        for task in tasks:
            model = self._fresh()
            fit = self._fit(model, task.train, f"single {task.name}")
            out.append(self.row_scores(model, task))
            self._scored("single", task.name, {task.name: out[-1]}, fit)
        return out


def logged_result(kind: str, lines: list[dict[str, Any]], names: list[str]) -> Any:
    """A finished side's result, as `Baselines.<kind>` returns it, from its progress-log lines (--resume keeps
    the sides that finished before the cut)."""
    if kind == "mtl":
        return [lines[-1]["rows"][n] for n in names]
    if kind == "single":
        return [line["rows"][line["after"]] for line in lines]
    matrix: list[list[float | None]] = [[None] * len(names) for _ in names]
    for j, line in enumerate(lines):
        for i in range(j + 1):
            matrix[j][i] = row_mean(line["rows"][names[i]])
    return matrix, [lines[-1]["rows"][n] for n in names], [line["rows"][names[j]] for j, line in enumerate(lines)]


def logged_training(lines: list[dict[str, Any]]) -> tuple[float, int, int]:
    """A kept side's training from its log lines: (seconds, tokens, lines that carry no timing). A line written
    before the log carried timing counts as untimed, not as zero work passed off as measured."""
    timed = [x for x in lines if "train_s" in x]
    return sum(x["train_s"] for x in timed), sum(x["train_tokens"] for x in timed), len(lines) - len(timed)


def _one_side(kind: str, model_path: Path, cfg: TrainConfig, tasks: list[Task], log: ProgressLog, share: int) -> Any:
    """A baseline in a process of its own: its result, training seconds and tokens. On a CPU the sides and the
    server split the cores (`share` ways): full thread pools on the same cores slow every side many times over."""
    import torch

    if resolve_device() == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // share))
    bl = Baselines(model_path, cfg, log, bars=False)  # several bars and the server's job bar would interleave
    return getattr(bl, kind)(tasks), bl.train_s, bl.tokens


class BaselineSides:
    """The baselines a run needs ("single", "seq", "mtl"). In-process (`parallel` off) they run when `results()`
    is called, after the server's sequence. With `parallel` each starts in its own process on entry; leaving
    the block stops any still running, so a failed server sequence does not leave them training."""

    def __init__(
        self,
        baselines: Baselines,
        kinds: list[str],
        tasks: list[Task],
        parallel: bool,
        kept: dict[str, Any] | None = None,
    ) -> None:
        self.bl, self.tasks, self.parallel = baselines, tasks, parallel
        self.kept = kept or {}  # results of sides an earlier run finished (--resume): not run again
        self.kinds = [k for k in kinds if k not in self.kept]
        self._pool: Any = None
        self._pending: dict[str, Any] = {}

    def __enter__(self) -> BaselineSides:
        if self.parallel and self.kinds:
            import multiprocessing as mp

            self._pool = mp.get_context("spawn").Pool(len(self.kinds))  # spawn: no forked torch or CUDA state
            args = (self.bl.path, self.bl.cfg, self.tasks, self.bl.log, len(self.kinds) + 1)
            self._pending = {k: self._pool.apply_async(_one_side, (k, *args)) for k in self.kinds}
        return self

    def check(self) -> None:
        """Raise a side's error as soon as it has failed (out of GPU memory, say), not after the server's whole
        sequence: called between tasks."""
        for kind, pending in self._pending.items():
            if pending.ready() and not pending.successful():
                try:
                    pending.get()
                except Exception as e:
                    raise RuntimeError(f"the {kind} baseline failed: {type(e).__name__}: {e}") from e

    def results(self) -> dict[str, Any]:
        out = dict(self.kept)
        if not self._pending:
            return out | {k: getattr(self.bl, k)(self.tasks) for k in self.kinds}
        for kind, pending in self._pending.items():
            out[kind], train_s, tokens = pending.get()
            self.bl.train_s += train_s
            self.bl.tokens += tokens
        return out

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
