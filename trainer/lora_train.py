"""The PEFT side of training a skill block (loss on answer tokens only), shared by every method: encoding chats,
injecting and saving the block, and `fit`, plain training; the steps themselves are loop.py's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from skillpool.lora.dropout import use_fast_dropout

from .config import CHECKPOINTING, TrainConfig
from .loop import Encoded, Method, Progress, Schedule, TrainLoop
from .records import Example


def encode_example(tokenizer: Any, ex: Example, max_len: int) -> Encoded:
    """Token ids and labels (-100 on the prompt) in the tokenizer's chat format, as served."""
    prompt = tokenizer.apply_chat_template(ex["messages"], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(ex["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    answer_ids = answer_ids[:max_len]
    prompt_ids = prompt_ids[-(max_len - len(answer_ids)) :] if max_len > len(answer_ids) else []
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


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
    TrainLoop(Method(peft_model), encoded, pad_id(tokenizer), schedule_of(cfg), on_progress, should_stop).run()
    return peft_model


def pad_id(tokenizer: Any) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


def add_lora(
    model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: Sequence[str], seed: int
) -> nn.Module:
    """A fresh PEFT LoRA injected into `model` in place (`.unload()` takes it out); seeded so A's init repeats."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=rank,
            lora_alpha=alpha,  # type: ignore[arg-type]  # annotated int; PEFT scales by a float alpha just the same
            lora_dropout=dropout,
            target_modules=list(target_modules),
            task_type="CAUSAL_LM",
        ),
    )
    use_fast_dropout(peft_model)
    return peft_model


def fit(
    peft_model: nn.Module,
    encoded: Sequence[Encoded],
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
    schedule = Schedule(epochs, batch_size, learning_rate, seed, weight_decay, warmup_ratio)
    TrainLoop(Method(peft_model), encoded, pad_token_id, schedule, on_progress, should_stop).run()
    return peft_model


def schedule_of(cfg: TrainConfig) -> Schedule:
    """The upload's hyperparameters as the loop takes them."""
    return Schedule(
        cfg.epochs,
        cfg.batch_size,
        cfg.learning_rate,
        cfg.seed,
        cfg.weight_decay,
        cfg.warmup_ratio,
        CHECKPOINTING[cfg.gradient_checkpointing],
        dtype=None if cfg.dtype == "auto" else cfg.dtype,  # auto: the trainer's --dtype
    )


def save_adapter(peft_model: nn.Module, folder: Path, base_model_id: str) -> None:
    """Write plain PEFT files (adapter_config.json + adapter_model.safetensors)."""
    peft_model.peft_config["default"].base_model_name_or_path = base_model_id  # type: ignore[index,union-attr]
    peft_model.save_pretrained(str(folder), safe_serialization=True)  # type: ignore[operator]
