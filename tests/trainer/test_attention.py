"""While the loop trains under bfloat16 autocast on a CPU, attention runs in float32 with autocast off (and only
then), the model's own attention comes back after, and the step trains as a float32 attention would."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

import skillpool.trainer.attention as attention
from skillpool.trainer.loop import Method, TrainLoop
from tests.trainer.test_loop import SCHEDULE, examples, peft_model, trainable


def spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, bool]]:
    """What the float32 attention's inner SDPA sees: the query's dtype, and whether autocast was on."""
    seen: list[tuple[torch.dtype, bool]] = []
    inner = attention.sdpa_attention_forward

    def recording(module: Any, query: torch.Tensor, *args: Any, **kw: Any) -> Any:
        seen.append((query.dtype, torch.is_autocast_enabled(query.device.type)))
        return inner(module, query, *args, **kw)

    monkeypatch.setattr(attention, "sdpa_attention_forward", recording)
    return seen


def test_bfloat16_training_attends_in_float32_and_gives_the_model_its_attention_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = spy(monkeypatch)
    model = peft_model()
    inner = model.get_base_model()
    assert inner.config._attn_implementation == "sdpa"
    TrainLoop(Method(model), examples(6), 0, replace(SCHEDULE, dtype="bfloat16")).run()
    assert seen and all(s == (torch.float32, False) for s in seen)
    assert len(seen) % inner.config.num_hidden_layers == 0
    assert inner.config._attn_implementation == "sdpa"


def test_float32_training_keeps_the_models_own_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = spy(monkeypatch)
    model = peft_model()
    TrainLoop(Method(model), examples(6), 0, replace(SCHEDULE, dtype="float32")).run()
    assert seen == []


def test_bfloat16_training_with_float32_attention_trains_close_to_float32_training() -> None:
    """bfloat16 autocast rounds the products, not the training: the parameters land near float32 training's."""
    data = examples(9, seed=3)
    runs = {}
    for name, dtype in (("f32", "float32"), ("bf16", "bfloat16")):
        model = peft_model()
        TrainLoop(Method(model), data, 0, replace(SCHEDULE, dtype=dtype)).run()
        runs[name] = trainable(model)
    start = trainable(peft_model())
    for k in runs["f32"]:
        moved = (runs["f32"][k] - start[k]).abs().max()
        assert moved > 0
        assert (runs["bf16"][k] - runs["f32"][k]).abs().max() <= 0.1 * moved + 1e-6, k
