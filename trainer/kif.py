"""Recurrent-KIF: learn a new LoRA block on a task while protecting what a memory buffer of earlier tasks needs.

Training runs cycles. Each cycle takes Q inner steps on the new task from `start`, then one outer step on a
memory batch, and keeps only the important part of each: θ = start + m_in ⊙ τ_in + m_out ⊙ τ_out, where the
masks hold the top share of each tensor's coordinates by EMA-smoothed importance |grad ⊙ θ|. Coordinates
important to neither fall back to the cycle start, so the new task cannot drift them away from what the
memory relies on. Only the trainable parameters (the new block) are fused; old blocks stay frozen.

The default share is 1.0, which keeps both updates whole. The paper masks because every task shares one
model; in skillpool each block is its task's own and earlier blocks are frozen, and a 20% mask starved
free-text tasks (issue 18). What remains is the start from similar blocks and the memory's outer steps.
At share 1.0 the fusion is the identity (start + τ_in + τ_out is where the cycle ended) and the importance
it would rank by goes unused, so the loop skips both: no per-step EMA over every tensor, no snapshots, no
sorts, which on a GPU are hundreds of small kernel launches a step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from skillpool.adapters_store.lora import LoRAAdapter, mix_delta

from .loop import Encoded, Method, Progress, ProgressMeter, Schedule, TrainLoop, answer_loss, collate

ADAPTER = "default"  # the PEFT adapter name add_lora trains
PEFT_PREFIX = "base_model.model."  # PEFT module names = this + the base model's module path


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


def _lora_layers(peft_model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(base model module path, PEFT LoRA layer) for every layer carrying the trainable adapter."""
    for name, module in peft_model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, nn.ModuleDict) and ADAPTER in lora_a:
            yield name.removeprefix(PEFT_PREFIX), module


def _factors(layer: nn.Module) -> tuple[Tensor, Tensor, float]:
    """A PEFT LoRA layer's trainable (A, B) weights and scaling."""
    a = cast(nn.Linear, cast(nn.ModuleDict, layer.lora_A)[ADAPTER])
    b = cast(nn.Linear, cast(nn.ModuleDict, layer.lora_B)[ADAPTER])
    return a.weight, b.weight, float(cast(dict[str, float], layer.scaling)[ADAPTER])


def init_from_blocks(peft_model: nn.Module, blocks: Sequence[tuple[LoRAAdapter, float]]) -> int:
    """Start the PEFT model's trainable LoRA block (adapter "default") at the best rank-r approximation of
    the router-weighted mix Σ_j w_j · s_j · B_j A_j of existing blocks (weights normalized to sum 1), per module,
    by truncated SVD: s·B·A = U_r S_r V_rᵀ with B = U_r √S_r / √s, A = √S_r V_rᵀ / √s (s = the new block's scaling).
    Modules no existing block has keep PEFT's init. Returns the number of modules initialized.

    Components with a (numerically) zero singular value, e.g. when the blocks' total rank is below r, get B = 0
    and keep PEFT's random A row: the product is unchanged, and the direction stays trainable (A = B = 0 would be
    a saddle the gradient never leaves).
    """
    if not blocks:
        return 0
    total = sum(w for _, w in blocks)
    if any(w < 0 for _, w in blocks) or total <= 0:
        raise ValueError(f"block weights must be >= 0 with a positive sum, got {[w for _, w in blocks]}")
    weights = [(adapter, w / total) for adapter, w in blocks]
    count = 0
    for path, layer in _lora_layers(peft_model):
        mix = [(adapter.modules[path], w) for adapter, w in weights if path in adapter.modules]
        if not mix:
            continue
        a_weight, b_weight, scaling = _factors(layer)
        if scaling <= 0:
            raise ValueError(f"{path}: the new block's scaling must be > 0, got {scaling}")
        target = mix_delta(mix).to(device=a_weight.device, dtype=torch.float32)  # mix in float32
        rank, expected = a_weight.shape[0], (b_weight.shape[0], a_weight.shape[1])
        if tuple(target.shape) != expected:
            raise ValueError(f"{path}: existing blocks give a {tuple(target.shape)} delta, the layer needs {expected}")
        U, S, Vh = torch.linalg.svd(target, full_matrices=False)
        k = min(rank, S.shape[0])
        # split √S evenly between the factors so neither dwarfs the other (balanced gradients for both)
        root = (S[:k] / scaling).sqrt()
        new_b = torch.zeros(expected[0], rank, device=target.device)
        new_a = a_weight.detach().float().clone()  # PEFT's init, kept only for the null components
        alive = S[:k] > S[0] * 1e-6  # relative: the mix's scale is arbitrary
        new_b[:, :k] = U[:, :k] * root * alive
        new_a[:k][alive] = (root[:, None] * Vh[:k])[alive]
        with torch.no_grad():
            a_weight.copy_(new_a.to(a_weight.dtype))  # written back in the layer's dtype
            b_weight.copy_(new_b.to(b_weight.dtype))
        count += 1
    return count


def probe_loss(peft_model: nn.Module, probe: Sequence[Encoded], pad_token_id: int, batch_size: int = 8) -> float:
    """Mean answer-token cross-entropy of the model as it stands on `probe` (no dropout, no grad)."""
    was_training = peft_model.training
    peft_model.eval()
    device = next(peft_model.parameters()).device
    total, tokens = 0.0, 0
    try:
        with torch.no_grad():
            for i in range(0, len(probe), batch_size):
                batch = {k: v.to(device) for k, v in collate(probe[i : i + batch_size], pad_token_id).items()}
                n = int((batch["labels"][:, 1:] != -100).sum())
                total += float(answer_loss(peft_model, batch)) * n  # the batch's mean back to a sum
                tokens += n
    finally:
        peft_model.train(was_training)
    if tokens == 0:
        raise ValueError("the probe has no answer tokens to score")
    return total / tokens


@dataclass(frozen=True)
class StartChoice:
    """Which start the new block trains from, and every candidate's probe loss (blocks {} = fresh)."""

    blocks: dict[str, float]
    candidates: list[dict[str, object]]  # [{"blocks": {...}, "loss": float}], fresh first


def start_candidates(seeds: dict[str, float]) -> list[dict[str, float]]:
    """Fresh, each seed block alone, and their router-weighted mix: a mix can help where no single block
    does, and a single block where the mix blurs it."""
    out: list[dict[str, float]] = [{}] + [{name: 1.0} for name in seeds]
    if len(seeds) > 1:
        out.append(dict(seeds))
    return out


def choose_start(
    peft_model: nn.Module,
    seeds: dict[str, tuple[LoRAAdapter, float]],
    probe: Sequence[Encoded],
    pad_token_id: int,
    margin: float,
    apply: bool = True,
) -> StartChoice:
    """Seed the new block from earlier blocks only where that helps the new task (issue 18: starting from
    the nearest blocks transferred negatively on tasks they did not help). Every candidate start is scored
    by its answer loss on `probe`, rows of the new task seen before any training step; the best one wins
    if its loss is below fresh's by the relative `margin`, else the block starts fresh (PEFT's init,
    restored exactly). A block of the same format but another label set is confidently wrong on the new
    task, so its loss is above fresh's rather than below. `apply` False leaves the model at fresh (for a
    `StartTrial` of the choice against fresh).
    """
    layers = [_factors(layer) for _, layer in _lora_layers(peft_model)]
    fresh = [(a.detach().clone(), b.detach().clone()) for a, b, _ in layers]

    def reset() -> None:
        with torch.no_grad():
            for (a, b, _), (a0, b0) in zip(layers, fresh, strict=True):
                a.copy_(a0)
                b.copy_(b0)

    scored: list[dict[str, object]] = []
    for blocks in start_candidates({name: w for name, (_, w) in seeds.items()}):
        reset()
        init_from_blocks(peft_model, [(seeds[name][0], w) for name, w in blocks.items()])
        scored.append({"blocks": blocks, "loss": probe_loss(peft_model, probe, pad_token_id)})
    fresh_loss = cast(float, scored[0]["loss"])
    best = min(scored[1:], key=lambda c: cast(float, c["loss"]), default=scored[0])
    chosen = cast(dict[str, float], best["blocks"]) if cast(float, best["loss"]) < fresh_loss * (1 - margin) else {}
    reset()
    if apply:
        init_from_blocks(peft_model, [(seeds[name][0], w) for name, w in chosen.items()])
    return StartChoice(chosen, scored)


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


def fit_kif(
    peft_model: nn.Module,
    new: Sequence[Encoded],
    memory: Sequence[Encoded],
    pad_token_id: int,
    *,
    epochs: float,
    batch_size: int,
    learning_rate: float,
    seed: int,
    weight_decay: float = 0.0,
    warmup_ratio: float = 0.0,
    settings: KIFSettings = KIFSettings(),
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> nn.Module:
    """Train the PEFT model's trainable block on `new` with Recurrent-KIF against the `memory` buffer.

    Same batches, optimizer (AdamW), warmup/linear-decay schedule and grad clip as `fit`, plus one outer step
    on a memory batch after every `inner_steps` new-task steps. Empty memory is plain `fit`. Returns
    `peft_model` with train mode off.
    """
    schedule = Schedule(epochs, batch_size, learning_rate, seed, weight_decay, warmup_ratio)
    train_kif(peft_model, new, memory, pad_token_id, schedule, settings, None, on_progress, should_stop)
    return peft_model


@dataclass(frozen=True)
class StartTrial:
    """Finalist starts for a kif block, each trained for the run's first `cycles` cycles and then judged by
    answer loss on `held_out` rows of the new task (issue 18). A loss before any step favours any block that
    teaches the answer format, which a fresh block also learns in its first steps: on the yelp sequence rte
    started from boolqa's block (True/False) and ended at 42 against 50 trained alone."""

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
    """`fit_kif` for a `Schedule`. Without a `trial` it trains from the start the model holds and returns [].
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
