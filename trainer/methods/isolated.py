"""Method isolated: a fresh LoRA block trained on the task alone."""

from __future__ import annotations

from typing import Any

from ..lora_train import fit_config
from .base import BlockJob, LoRAMethod


class IsolatedMethod(LoRAMethod):
    name = "isolated"

    def fit(self, job: BlockJob, peft_model: Any) -> dict[str, Any]:
        fit_config(peft_model, job.tok, job.train, job.cfg, job.on_progress, job.should_stop)
        return {}
