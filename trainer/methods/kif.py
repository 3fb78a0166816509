"""Method kif, Recurrent-KIF: learn a new LoRA block on a task while protecting what a memory buffer of earlier
tasks needs.

The block starts from the most similar earlier blocks whose answers are of the new task's kind when that lowers
the new task's loss before training, else fresh (kif_start.py). Training runs cycles. Each cycle takes Q inner
steps on the new task from `start`, then one outer step on a memory batch (the stored samples of every earlier
skill of the same answer kind), and keeps only the important part of each: θ = start + m_in ⊙ τ_in + m_out ⊙ τ_out,
where the masks hold the top share of each tensor's coordinates by EMA-smoothed importance |grad ⊙ θ|.
Coordinates important to neither fall back to the cycle start, so the new task cannot drift them away from what
the memory relies on. Only the trainable parameters (the new block) are fused; old blocks stay frozen.

The default share is 1.0, which keeps both updates whole. The paper masks because every task shares one
model; in skillpool each block is its task's own and earlier blocks are frozen, so a mask only cuts what the
new task learns (docs/skills.md#methods). What remains is the start from similar blocks and the memory's
outer steps. At share 1.0 the fusion is the identity (start + τ_in + τ_out is where the cycle ended) and the
importance it would rank by goes unused, so the loop skips both: no per-step EMA over every tensor, no
snapshots, no sorts, which on a GPU are hundreds of small kernel launches a step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from skillpool.lora.adapter import LoRAAdapter

from ..loop import Encoded, Method, Progress, ProgressMeter, Schedule, TrainLoop
from ..lora_train import encode_example, pad_id, schedule_of
from ..scoring import metric_for
from .base import BlockJob, LoRAMethod
from .kif_start import choose_start, init_from_blocks, latest, probe_loss, similar_skills, unlike_answers


@dataclass(frozen=True)
class KIFSettings:
    inner_steps: int = 8  # Q: new-task steps per cycle
    ema_in: float = 0.55  # α, EMA of the new task's importance
    ema_hist: float = 0.55  # β, EMA of the memory's importance
    top_q: float = 1.0  # share of coordinates kept per tensor by each mask (see TrainConfig.kif_top_q)
    init_blocks: int = 3  # at most this many similar existing blocks seed the new block

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {self.inner_steps}")
        for name in ("ema_in", "ema_hist"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 < self.top_q <= 1:
            raise ValueError(f"top_q must be in (0, 1], got {self.top_q}")
        if self.init_blocks < 0:
            raise ValueError(f"init_blocks must be >= 0, got {self.init_blocks}")


def _top_mask(importance: Tensor, share: float) -> Tensor:
    """Boolean mask of the top `share` of a tensor's coordinates by importance (at least one)."""
    n = importance.numel()
    k = min(n, max(1, int(share * n + 1e-9)))  # epsilon: 0.29·100 must give 29, not 28
    mask = torch.zeros(n, dtype=torch.bool, device=importance.device)
    mask[importance.flatten().topk(k).indices] = True
    return mask.view_as(importance)


class KIF(Method):
    """Recurrent-KIF's hooks on the plain LoRA loop: at each cycle start a snapshot; after every backward the
    importance EMA of the step's kind (task or memory); after each cycle's last task step one memory step,
    then the masked fusion of the cycle's two updates. At share 1.0 only the memory step (`fuse` off)."""

    def __init__(
        self,
        peft_model: nn.Module,
        memory: Sequence[Encoded],
        settings: KIFSettings,
        seed: int,
        fuse: bool | None = None,  # None: only below share 1.0; True runs the identity fusion too (tests, bench)
    ) -> None:
        super().__init__(peft_model)
        self.memory, self.settings = memory, settings
        self.memory_rng = random.Random(f"{seed}:kif-memory")  # its own stream: memory draws leave task batches be
        self.params = [p for p in peft_model.parameters() if p.requires_grad]
        self.fuse = settings.top_q < 1 if fuse is None else fuse  # at 1.0 θ is already the fused point
        tracked = self.params if self.fuse else []
        self.imp_in = [torch.zeros_like(p, dtype=torch.float32) for p in tracked]  # kept across cycles
        self.imp_hist = [torch.zeros_like(p, dtype=torch.float32) for p in tracked]
        self.importance, self.decay = self.imp_in, settings.ema_in  # which EMA the next backward feeds
        self.start_point: list[Tensor] = []

    def total_steps(self, task_steps: int) -> int:
        return task_steps + -(-task_steps // self.settings.inner_steps)  # one outer step per (partial) cycle

    def before_task_step(self, loop: TrainLoop) -> None:
        if self.fuse and loop.task_steps % self.settings.inner_steps == 0:
            self.start_point = [p.detach().clone() for p in self.params]

    def after_backward(self, loop: TrainLoop) -> None:
        if not self.fuse:
            return
        with torch.no_grad():  # importance from the raw gradient at the θ it was taken at, before clip and step
            for imp, p in zip(self.importance, self.params, strict=True):
                if p.grad is not None:
                    imp.mul_(self.decay).add_((p.grad.float() * p.float()).abs(), alpha=1 - self.decay)
                else:
                    imp.mul_(self.decay)

    def after_task_step(self, loop: TrainLoop) -> None:
        if loop.task_steps % self.settings.inner_steps and loop.task_steps < loop.task_total:
            return  # mid-cycle
        before_outer = [p.detach().clone() for p in self.params] if self.fuse else []
        n, size = len(self.memory), loop.schedule.batch_size
        # a small buffer still fills the batch, with repeats
        picks = self.memory_rng.sample(range(n), size) if n >= size else self.memory_rng.choices(range(n), k=size)
        self.importance, self.decay = self.imp_hist, self.settings.ema_hist
        try:
            loop.step([self.memory[i] for i in picks], picks, report=False)  # its loss stays out of the progress
        finally:
            self.importance, self.decay = self.imp_in, self.settings.ema_in
        if not self.fuse:
            return
        q = self.settings.top_q
        with torch.no_grad():
            for p, s, mid, i_in, i_hist in zip(
                self.params, self.start_point, before_outer, self.imp_in, self.imp_hist, strict=True
            ):
                tau_in, tau_out = mid - s, p - mid
                p.copy_(s + tau_in * _top_mask(i_in, q) + tau_out * _top_mask(i_hist, q))  # both add where both hold


def _kif_loop(
    peft_model: nn.Module,
    new: Sequence[Encoded],
    memory: Sequence[Encoded],
    pad_token_id: int,
    schedule: Schedule,
    settings: KIFSettings,
    on_progress: Callable[[Progress], None] | None,
    should_stop: Callable[[], bool] | None,
) -> TrainLoop:
    # nothing to protect without memory: KIF would only mask away useful updates
    method = KIF(peft_model, memory, settings, schedule.seed) if memory else Method(peft_model)
    return TrainLoop(method, new, pad_token_id, schedule, on_progress, should_stop)


@dataclass(frozen=True)
class StartTrial:
    """Finalist starts for a kif block, each trained for the run's first `cycles` cycles and then judged by
    answer loss on `held_out` rows of the new task. A loss before any step favours any block that teaches the
    answer format, which a fresh block also learns in its first steps."""

    blocks: Mapping[str, LoRAAdapter]
    starts: Sequence[dict[str, float]]  # {} is fresh (the PEFT init the model holds on entry)
    held_out: Sequence[Encoded]
    margin: float  # a start other than the first must beat the first's loss by this share
    cycles: int = 1

    def __post_init__(self) -> None:
        if not self.starts or not self.held_out or self.cycles < 1:
            raise ValueError("a start trial needs starts, held-out rows and cycles >= 1")


def train_kif(
    peft_model: nn.Module,
    new: Sequence[Encoded],
    memory: Sequence[Encoded],
    pad_token_id: int,
    schedule: Schedule,
    settings: KIFSettings = KIFSettings(),
    trial: StartTrial | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[dict[str, object]]:
    """Train the PEFT model's trainable block on `new` with Recurrent-KIF against the `memory` buffer: the
    batches, optimizer (AdamW), warmup/linear-decay schedule and grad clip of plain training, plus one outer
    step on a memory batch after every `inner_steps` new-task steps (empty memory: plain training). The
    model's train mode is off after.

    Without a `trial` it trains from the start the model holds and returns [].
    With one, from the best of `trial.starts`: each start trains the run's first cycles, the one with the
    lowest held-out loss (the first unless another beats it by `trial.margin`) then trains on from where its
    trial left it, so its run is the same as training from it alone. Returns every start's blocks and held-out
    loss, the kept one marked `"kept": True`."""
    if trial is None:
        _kif_loop(peft_model, new, memory, pad_token_id, schedule, settings, on_progress, should_stop).run()
        return []
    params = [p for p in peft_model.parameters() if p.requires_grad]
    fresh = [p.detach().clone() for p in params]

    def restore(values: Sequence[Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(params, values, strict=True):
                p.copy_(v)

    runs: list[tuple[TrainLoop, list[Tensor], float]] = []
    meter: ProgressMeter | None = None
    for blocks in trial.starts:
        restore(fresh)
        init_from_blocks(peft_model, [(trial.blocks[name], w) for name, w in blocks.items()])
        loop = _kif_loop(peft_model, new, memory, pad_token_id, schedule, settings, on_progress, should_stop)
        until = min(trial.cycles * settings.inner_steps, loop.task_total)
        if meter is None:  # one progress count over every trial and the rest of the kept run
            meter = ProgressMeter(loop.total + (len(trial.starts) - 1) * loop.method.total_steps(until), on_progress)
        loop.meter = meter
        loop.run(until)
        runs.append((loop, [p.detach().clone() for p in params], probe_loss(peft_model, trial.held_out, pad_token_id)))
    first = runs[0][2]
    best = min(range(1, len(runs)), key=lambda i: runs[i][2], default=0)
    kept = best if runs[best][2] < first * (1 - trial.margin) else 0
    loop, values, _ = runs[kept]
    restore(values)
    loop.run()
    return [
        {"blocks": blocks, "held_out_loss": loss, **({"kept": True} if i == kept else {})}
        for i, (blocks, (_, _, loss)) in enumerate(zip(trial.starts, runs, strict=True))
    ]


class KIFMethod(LoRAMethod):
    name = "kif"

    def fit(self, job: BlockJob, peft_model: Any) -> dict[str, Any]:
        """Recurrent-KIF on the new block: seeded from similar blocks where the probe (and the trial, if on) says
        that helps, or from the newest block of its answer kind (kif_start "latest"); fused against the memory."""
        name, train, held, cfg, tok = job.name, job.train, job.held, job.cfg, job.tok
        kind = metric_for([e["answer"] for e in train])
        earlier = [rec for rec in job.store.list_latest() if rec.name != name]  # one read: starts and memory
        unlike = unlike_answers(earlier, kind)
        similar = cfg.kif_start == "similar"  # else "latest": no probe, no trial
        if similar:
            texts = [e["route_text"] for e in train]
            seeds = similar_skills(job.router, name, texts, cfg.kif_init_blocks, unlike)
        else:
            seeds = latest(earlier, unlike) if cfg.kif_init_blocks > 0 else {}
        encoded = [encode_example(tok, e, cfg.max_seq_len) for e in train]
        trial_rows = similar and cfg.kif_start_trial > 0
        held_out = [encode_example(tok, e, cfg.max_seq_len) for e in held] if trial_rows else []
        can_trial = bool(held_out)  # the trial is on and has rows to judge by
        start: dict[str, Any] = {"init_from": seeds, "answers": kind, "unlike_answers": sorted(unlike)}
        start["start"] = cfg.kif_start
        trial: StartTrial | None = None
        if seeds and cfg.kif_start_probe > 0 and similar:
            probe = random.Random(cfg.seed).sample(encoded, min(cfg.kif_start_probe, len(encoded)))
            blocks = {n: (job.record(n).adapter(), w) for n, w in seeds.items()}
            choice = choose_start(peft_model, blocks, probe, pad_id(tok), cfg.kif_start_margin, apply=not can_trial)
            start |= {"init_from": choice.blocks, "start_candidates": choice.candidates}
            if choice.blocks and can_trial:  # the probe's pick against fresh, judged again after training
                adapters = {n: blocks[n][0] for n in choice.blocks}
                trial = StartTrial(adapters, [{}, choice.blocks], held_out, cfg.kif_start_margin, cfg.kif_start_trial)
        elif seeds:
            init_from_blocks(peft_model, [(job.record(n).adapter(), w) for n, w in seeds.items()])
        # the memory holds only skills of the new task's answer kind: label rows replayed into a free-text block
        # pull it toward short answers
        remembered = [rec for rec in earlier if rec.name not in unlike]
        memory = [encode_example(tok, e, cfg.max_seq_len) for rec in remembered for e in rec.replay()]
        settings = KIFSettings(
            cfg.kif_inner_steps, cfg.kif_ema_in, cfg.kif_ema_hist, cfg.kif_top_q, cfg.kif_init_blocks
        )
        schedule = schedule_of(cfg)
        finalists = train_kif(
            peft_model, encoded, memory, pad_id(tok), schedule, settings, trial, job.on_progress, job.should_stop
        )
        if finalists:
            kept = next(f["blocks"] for f in finalists if f.get("kept"))
            start |= {"init_from": kept, "start_trial": finalists}
        return {"kif": {**start, "memory_examples": len(memory), "memory_skills": len(remembered)}}
