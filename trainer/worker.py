"""One training job, start to finish: split, router keys, LoRA training, held-out eval, atomic store write."""
from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from typing import Any

from adapters_store.base_model import BaseModel
from adapters_store.store import SkillDraft, SkillRecord, SkillStore
from router import Router

from .config import TrainConfig
from .evaluation import generate_greedy, mean_score, metric_for
from .lora_train import Progress, save_adapter, train_lora
from .pseudo import GeneratorConfig, pseudo_replay

log = logging.getLogger(__name__)
Example = dict[str, Any]


def split_examples(examples: list[Example], cfg: TrainConfig) -> tuple[list[Example], list[Example], list[Example], list[Example]]:
    """(train, eval, replay, probe): eval/probe are held out; replay is a small sample of train."""
    rng = random.Random(cfg.seed)
    shuffled = list(examples)
    rng.shuffle(shuffled)
    n_eval = min(cfg.max_eval_examples, math.ceil(len(shuffled) * cfg.eval_fraction)) if len(shuffled) >= 10 else 0
    held, train = shuffled[:n_eval], shuffled[n_eval:]
    replay = rng.sample(train, max(1, round(len(train) * cfg.replay_fraction))) if train else []
    return train, held, replay, held[: cfg.probe_size]


class SkillTrainer:
    """Trains skills against one base model and one router; used by the job queue's worker."""

    def __init__(self, store: SkillStore, router: Router, base: BaseModel, device: str | None = None, sync_router: bool = False) -> None:
        """`sync_router`: the router is private to this trainer (a Redis worker), so it is refreshed from the
        shared store before each job; a server's trainer shares the live router, which is always current."""
        self.store, self.router, self.base, self.device, self.sync_router = store, router, base, device, sync_router

    def _load_base(self) -> tuple[Any, Any]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        tok = AutoTokenizer.from_pretrained(str(self.base.path))
        model = AutoModelForCausalLM.from_pretrained(str(self.base.path), dtype=torch.float32).to(device)
        return model, tok

    def run(
        self,
        name: str,
        examples: list[Example],
        cfg: TrainConfig,
        method: str = "isolated",
        on_progress: Callable[[Progress], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> SkillRecord:
        train, held, replay, probe = split_examples(examples, cfg)
        train_texts = [e["route_text"] for e in train]
        router_tensors = self.router.prepare_keys(train_texts)
        router_meta: dict[str, Any] = {"mode": self.router.settings.mode, "threshold": float(router_tensors["threshold"][0])}
        model, tok = self._load_base()
        sapt = self.router.settings.sapt
        pseudo: list[str] = []
        if self.router.settings.mode == "sapt":
            if sapt.replay == "pseudo":  # this skill's own pseudo inputs, replayed when later skills learn
                pseudo = pseudo_replay(model, tok, train_texts, len(replay), GeneratorConfig(seed=cfg.seed), should_stop)
            if self.sync_router:
                self._sync_router()
            tensors, attention = self.router.prepare_sapt(name, train_texts, [e["route_text"] for e in held], self._replay_inputs(name))
            router_tensors.update(tensors)
            router_meta["sapt_attention"] = attention
        peft_model = train_lora(model, tok, train, cfg, on_progress=on_progress, should_stop=should_stop)
        eval_result = self.evaluate(peft_model, tok, train, held)
        draft = SkillDraft(
            name=name,
            write_adapter=lambda folder: save_adapter(peft_model, folder, self.base.model_id),
            router_tensors=router_tensors,
            meta={
                "base_model": {"id": self.base.model_id, "fingerprint": self.base.fingerprint},
                "training": {"method": method, "config": cfg.to_dict()},
                "eval": eval_result,
                "samples": {"total": len(examples), "train": len(train), "eval": len(held), "replay": len(replay), "probe": len(probe)},
                "router": router_meta,
            },
            replay=replay,
            probe=probe,
            pseudo=pseudo,
        )
        return self.store.write(draft)

    def _sync_router(self) -> None:
        """Load every stored skill's router tensors: the SAPT state a new skill learns on top of."""
        for rec in self.store.list_latest():
            self.router.add_skill(rec.name, rec.router_tensors(), (rec.meta.get("router") or {}).get("sapt_attention"))

    def _replay_inputs(self, name: str) -> dict[str, list[str]]:
        """Earlier skills' replay inputs for attentive reflection: their stored real samples, or their
        generated pseudo inputs when the setting asks for them and the skill has some."""
        out: dict[str, list[str]] = {}
        for rec in self.store.list_latest():
            if rec.name == name:
                continue
            pseudo = rec.pseudo() if self.router.settings.sapt.replay == "pseudo" else []
            out[rec.name] = [str(p) for p in pseudo] or [str(e["route_text"]) for e in rec.replay()]
        return out

    @staticmethod
    def evaluate(peft_model: Any, tok: Any, train: list[Example], held: list[Example]) -> dict[str, Any]:
        """Score the new block and the plain base model on the held-out split."""
        metric = metric_for([e["answer"] for e in train])
        if not held:
            return {"metric": metric, "score": None, "base_score": None, "n": 0}
        refs = [e["answer"] for e in held]
        longest = max(len(tok(e["answer"], add_special_tokens=False)["input_ids"]) for e in train)
        budget = min(256, longest + 8)
        prompts = [e["messages"] for e in held]
        score = mean_score(metric, generate_greedy(peft_model, tok, prompts, budget), refs)
        with peft_model.disable_adapter():
            base_score = mean_score(metric, generate_greedy(peft_model, tok, prompts, budget), refs)
        return {"metric": metric, "score": score, "base_score": base_score, "n": len(held)}
