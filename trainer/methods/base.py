"""What every training method implements: from one skill's split and the loaded base model to its trained block
(plain PEFT files in the job's folder) and what the method adds to the skill's record."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from skillpool.adapters_store.store import SkillRecord, SkillStore
from skillpool.router import Router

from ..config import TrainConfig
from ..loop import Progress
from ..lora_train import add_lora, save_adapter
from ..records import Example


@dataclass
class BlockJob:
    """One skill's block to train: its split, the base model it trains on, where the block goes, and the
    store and router that hold the earlier skills."""

    name: str
    train: list[Example]
    held: list[Example]
    cfg: TrainConfig
    model: Any  # the plain HF causal LM, float32 on the trainer's device
    tok: Any
    folder: Path  # the block's PEFT files go here
    base_model_id: str
    store: SkillStore
    router: Router
    on_progress: Callable[[Progress], None]
    should_stop: Callable[[], bool] | None
    check: Callable[[], None]  # stop_check(should_stop): for the stages outside the training loop

    def record(self, name: str) -> SkillRecord:
        """An earlier skill's version that serves (a rollback may pin an older one)."""
        rec = self.store.serving(name)
        if rec is None:
            raise KeyError(f"skill {name!r} is in the router but not in the store at {self.store.root}")
        return rec

    def replay_inputs(self) -> dict[str, list[str]]:
        return replay_inputs(self.store, self.router, self.name)


def replay_inputs(store: SkillStore, router: Router, name: str) -> dict[str, list[str]]:
    """Earlier skills' replay inputs for attentive reflection: their stored real samples, or their generated pseudo
    inputs when the setting asks for them and the skill has some."""
    out: dict[str, list[str]] = {}
    for rec in store.list_latest():
        if rec.name == name:
            continue
        pseudo = rec.pseudo() if router.settings.sapt.replay == "pseudo" else []
        out[rec.name] = [str(p) for p in pseudo] or [str(e["route_text"]) for e in rec.replay()]
    return out


@dataclass
class TrainedBlock:
    """A method's result beside the block's files in the job's folder."""

    model: Any  # the plain base model again, for the quality gate's routed generation
    router_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # what it learned for the router
    attention: dict[str, float] | None = None  # sapt: the skill's mean attention by block
    training: dict[str, Any] = field(default_factory=dict)  # meta.training entries beside method and config


class TrainingMethod(ABC):
    name: ClassVar[str]
    # sapt: the block trains with its router key, so the trainer does not learn the key apart
    learns_router_key: ClassVar[bool] = False

    @classmethod
    def router_error(cls, router_mode: str) -> str | None:
        """Why this method cannot train under a router in `router_mode`, or None when it can."""
        return None

    @abstractmethod
    def train(self, job: BlockJob) -> TrainedBlock:
        """Train the new block on `job.train`, write it to `job.folder` and give the base model back."""


class LoRAMethod(TrainingMethod):
    """A fresh PEFT LoRA injected into the base model, trained by `fit`, saved, and taken out again."""

    def train(self, job: BlockJob) -> TrainedBlock:
        cfg = job.cfg
        peft_model = add_lora(job.model, cfg.rank, cfg.alpha, cfg.dropout, cfg.target_modules, cfg.seed)
        training = self.fit(job, peft_model)
        save_adapter(peft_model, job.folder, job.base_model_id)
        return TrainedBlock(model=cast(Any, peft_model).unload(), training=training)

    @abstractmethod
    def fit(self, job: BlockJob, peft_model: Any) -> dict[str, Any]:
        """Train `peft_model`'s block in place; the meta.training entries to store with it."""
