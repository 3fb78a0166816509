"""Where a new kif block starts: which earlier skills may seed it, the SVD start from their blocks, and the
probe that keeps such a start only where it lowers the new task's loss before training."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from skillpool.adapters_store.store import SkillRecord
from skillpool.lora.adapter import LoRAAdapter, mix_delta
from skillpool.router import Router

from ..loop import Encoded, answer_loss, collate

ADAPTER = "default"  # the PEFT adapter name add_lora trains
PEFT_PREFIX = "base_model.model."  # PEFT module names = this + the base model's module path


def unlike_answers(records: list[SkillRecord], kind: str) -> set[str]:
    """Skills among `records` whose answers are of another kind than `kind` (a label set, scored by exact match,
    against free text, scored by ROUGE-L): no start for a new kif block, nor rows in its memory buffer. A label
    block lowers a free-text task's loss before training only because it makes answers short."""
    return {rec.name for rec in records if (rec.meta.get("eval") or {}).get("metric") not in (None, kind)}


def latest(records: list[SkillRecord], exclude: set[str]) -> dict[str, float]:
    """kif_start "latest": the newest of `records` outside `exclude`, whole ({} when none). Started from it, each
    block continues the one before, as one LoRA trained on the tasks in turn does, and stays frozen as its
    task's block, so nothing it knew is lost."""
    newest = max((r for r in records if r.name not in exclude), key=lambda r: r.meta.get("created", 0.0), default=None)
    return {newest.name: 1.0} if newest is not None else {}


def similar_skills(
    router: Router, name: str, texts: list[str], k: int, exclude: set[str] | None = None, sample: int = 64
) -> dict[str, float]:
    """The k registered skills nearest to these inputs (none of `exclude`), by mean mix weight (normalized).
    Ungated: the new task's inputs are unseen, so the open-set and format gates would send most of them to
    the base model."""
    if k <= 0 or not texts:
        return {}
    share: dict[str, float] = {}
    for d in router.route(texts[:sample], open_set=False):
        for skill, w in d.route:
            if skill != name and skill not in (exclude or ()):
                share[skill] = share.get(skill, 0.0) + w
    top = sorted(share.items(), key=lambda kv: -kv[1])[:k]
    total = sum(w for _, w in top)
    return {s: w / total for s, w in top} if total > 0 else {}


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
    """Seed the new block from earlier blocks only where that helps the new task (starting from the nearest
    blocks transferred negatively on tasks they did not help: docs/skills.md#methods). Every candidate start is scored
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
