"""Isolated LoRA training of one skill block with PEFT (loss on answer tokens only)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import TrainConfig

Example = dict[str, Any]


class Cancelled(Exception):
    pass


@dataclass
class Progress:
    step: int
    total: int
    loss: float | None
    tokens_per_s: float
    eta_s: float | None
    tokens: int = 0  # tokens processed so far (prompt + answer), for throughput reports


def encode_example(tokenizer: Any, ex: Example, max_len: int) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 on the prompt) in the tokenizer's chat format, as served."""
    prompt = tokenizer.apply_chat_template(ex["messages"], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(ex["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    answer_ids = answer_ids[:max_len]
    prompt_ids = prompt_ids[-(max_len - len(answer_ids)) :] if max_len > len(answer_ids) else []
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


def _batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of similar length (less padding on CPU), in shuffled order."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    chunk = batch_size * 16
    batches = []
    for i in range(0, len(order), chunk):
        group = sorted(order[i : i + chunk], key=lambda j: lengths[j])
        batches += [group[k : k + batch_size] for k in range(0, len(group), batch_size)]
    rng.shuffle(batches)
    return batches


def _collate(items: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, (x, y) in enumerate(items):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def answer_loss(peft_model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy on answer tokens, projecting only those positions through the LM head.

    Same value as the model's own loss, but the (tokens × vocab) logits are computed for the few
    answer tokens only instead of every prompt token: about a fifth less compute for SmolLM2.
    """
    inner = peft_model.get_base_model()  # type: ignore[operator]
    hidden = inner.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    logits = inner.get_output_embeddings()(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])


def fit_config(
    peft_model: nn.Module,
    tokenizer: Any,
    examples: Sequence[Example],
    cfg: TrainConfig,
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> nn.Module:
    """`fit` on chat examples with the upload's hyperparameters."""
    encoded = [encode_example(tokenizer, ex, cfg.max_seq_len) for ex in examples]
    return fit(
        peft_model,
        encoded,
        pad_id(tokenizer),
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate,
        seed=cfg.seed,
        weight_decay=cfg.weight_decay,
        warmup_ratio=cfg.warmup_ratio,
        on_progress=on_progress,
        should_stop=should_stop,
    )


def pad_id(tokenizer: Any) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


def add_lora(
    model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: Sequence[str], seed: int
) -> nn.Module:
    """A fresh PEFT LoRA injected into `model` in place (`.unload()` takes it out); seeded so A's init repeats."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(
        model,
        LoraConfig(
            r=rank,
            lora_alpha=alpha,  # type: ignore[arg-type]  # annotated int; PEFT scales by a float alpha just the same
            lora_dropout=dropout,
            target_modules=list(target_modules),
            task_type="CAUSAL_LM",
        ),
    )


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


def fit(
    peft_model: nn.Module,
    encoded: Sequence[tuple[list[int], list[int]]],
    pad_token_id: int,
    *,
    epochs: float,
    batch_size: int,
    learning_rate: float,
    seed: int,
    weight_decay: float = 0.0,
    warmup_ratio: float = 0.0,
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> nn.Module:
    """Train the PEFT model's trainable parameters on (token ids, labels) pairs with `answer_loss`.

    AdamW, linear warmup then linear decay, grad-norm clip 1.0. Returns `peft_model` with train mode off.
    """
    if not encoded:
        raise ValueError("nothing to train on: no encoded examples")  # else the step loop below never ends
    rng = random.Random(seed)
    lengths = [len(x) for x, _ in encoded]
    steps_per_epoch = math.ceil(len(encoded) / batch_size)
    total = max(1, math.ceil(steps_per_epoch * epochs))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay)
    sched = warmup_then_decay(opt, total, warmup_ratio)
    device = next(peft_model.parameters()).device
    peft_model.train()
    meter = ProgressMeter(total, on_progress)
    while meter.step < total:
        for batch_ids in _batches(lengths, batch_size, rng):
            if meter.step >= total:
                break
            if should_stop is not None and should_stop():
                raise Cancelled()
            batch = {k: v.to(device) for k, v in _collate([encoded[i] for i in batch_ids], pad_token_id).items()}
            loss = answer_loss(peft_model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            meter.count(int(batch["attention_mask"].sum()), float(loss.detach()))
    peft_model.eval()
    return peft_model


def save_adapter(peft_model: nn.Module, folder: Path, base_model_id: str) -> None:
    """Write plain PEFT files (adapter_config.json + adapter_model.safetensors)."""
    peft_model.peft_config["default"].base_model_name_or_path = base_model_id  # type: ignore[index,union-attr]
    peft_model.save_pretrained(str(folder), safe_serialization=True)  # type: ignore[operator]
