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

    def __init__(self, store: SkillStore, router: Router, base: BaseModel, device: str | None = None) -> None:
        self.store, self.router, self.base, self.device = store, router, base, device

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
        router_tensors = self.router.prepare_keys([e["route_text"] for e in train])
        model, tok = self._load_base()
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
                "router": {"kind": "centroid_keys", "threshold": float(router_tensors["threshold"][0])},
            },
            replay=replay,
            probe=probe,
        )
        return self.store.write(draft)

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
