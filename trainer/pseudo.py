"""SAPT pseudo replay: a small generator LoRA per skill learns to emit the skill's inputs after `__gen__`.

Sampling from it stands in for stored samples when a skill's real inputs may not be kept
(SAPT's generative replay; docs/routing.md). Real stored samples remain the default replay source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .loop import Progress
from .lora_train import add_lora, fit, pad_id

GEN_PROMPT = "__gen__"
_ATTEMPTS = 3  # generation rounds: empty samples are resampled at most twice


@dataclass(frozen=True)
class GeneratorConfig:
    rank: int = 4
    alpha: float = 8.0
    learning_rate: float = 1e-3
    epochs: float = 1.0
    batch_size: int = 8  # for training and for sampling
    max_seq_len: int = 256  # prompt + text + EOS; longer texts are cut (and then get no EOS)
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 0.95
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    seed: int = 0


def _prompt_ids(tokenizer: Any) -> list[int]:
    # A plain prompt, not the chat template: the generator is never served, and no chat turn
    # should compete with the text it must produce.
    return list(tokenizer(GEN_PROMPT + "\n", add_special_tokens=False)["input_ids"])


def encode_text(tokenizer: Any, text: str, max_len: int) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 on the prompt): prompt, then the text, then EOS."""
    prompt = _prompt_ids(tokenizer)
    if max_len <= len(prompt):
        raise ValueError(f"max_seq_len {max_len} leaves no room after the {len(prompt)}-token generator prompt")
    # Cut before the end so that a truncated text gets no EOS: the generator must not learn to stop mid-text.
    body = (tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[: max_len - len(prompt)]
    return prompt + body, [-100] * len(prompt) + body


def train_generator(
    model: nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    cfg: GeneratorConfig,
    should_stop: Callable[[], bool] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> nn.Module:
    """Wrap `model` (in place) with a fresh generator LoRA trained on `texts`; return the PEFT model.

    Loss is on the text tokens and EOS only. On an error or `Cancelled`, the LoRA is taken out again.
    """
    kept = [t for t in texts if t.strip()]
    if not kept:
        raise ValueError("texts is empty: the generator needs at least one non-blank text to learn from")
    encoded = [encode_text(tokenizer, t, cfg.max_seq_len) for t in kept]
    restore = _restorer(model)
    peft_model = add_lora(model, cfg.rank, cfg.alpha, 0.0, cfg.target_modules, cfg.seed)
    try:
        return fit(
            peft_model,
            encoded,
            pad_id(tokenizer),
            epochs=cfg.epochs,
            batch_size=cfg.batch_size,
            learning_rate=cfg.learning_rate,
            seed=cfg.seed,
            on_progress=on_progress,
            should_stop=should_stop,
        )
    except BaseException:
        restore(peft_model)
        raise


def generate_pseudo_inputs(peft_model: nn.Module, tokenizer: Any, n: int, cfg: GeneratorConfig) -> list[str]:
    """Up to `n` non-empty sampled texts (fewer only if the generator keeps emitting empty ones).

    Reproducible for a given `cfg.seed`; the caller's global RNG state is left as it was.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    device = next(peft_model.parameters()).device
    prompt = torch.tensor([_prompt_ids(tokenizer)], device=device)
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p}
        if cfg.temperature > 0
        else {"do_sample": False}
    )
    out: list[str] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        for _ in range(_ATTEMPTS):
            missing = n - len(out)
            for start in range(0, missing, cfg.batch_size):
                ids = prompt.expand(min(cfg.batch_size, missing - start), -1)
                gen = peft_model.generate(  # type: ignore[operator]
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=cfg.max_new_tokens,
                    pad_token_id=pad_id(tokenizer),
                    eos_token_id=tokenizer.eos_token_id,
                    **sampling,
                )
                decoded = tokenizer.batch_decode(gen[:, prompt.shape[1] :], skip_special_tokens=True)
                out += [s for s in (d.strip() for d in decoded) if s]
            if len(out) >= n:
                break
    return out[:n]


def pseudo_replay(
    model: nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    n: int,
    cfg: GeneratorConfig,
    should_stop: Callable[[], bool] | None = None,
) -> list[str]:
    """Train a generator on `texts`, sample `n` pseudo inputs, and leave `model` exactly as it was."""
    if n < 0:  # checked before the costly training
        raise ValueError(f"n must be >= 0, got {n}")
    restore = _restorer(model)
    peft_model = train_generator(model, tokenizer, texts, cfg, should_stop=should_stop)
    try:
        return generate_pseudo_inputs(peft_model, tokenizer, n, cfg)
    finally:
        restore(peft_model)


def _restorer(model: nn.Module) -> Callable[[nn.Module], None]:
    """Undo of what PEFT changes in `model` in place: its LoRA layers, requires_grad flags and train mode."""
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    training = model.training

    def restore(peft_model: nn.Module) -> None:
        peft_model.unload()  # type: ignore[operator]  # puts the original modules (same weight tensors) back
        for name, p in model.named_parameters():
            p.requires_grad_(flags[name])
        model.train(training)

    return restore
