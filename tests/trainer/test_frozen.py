"""While the loop trains under bfloat16 autocast, the frozen base's linear weights are bfloat16 copies: the run trains
exactly as with autocast's own casts, the trainable and tied weights stay float32, and the float32 weights come back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import skillpool.trainer.loop as loop_module
from skillpool.trainer.frozen import frozen_linears_in
from skillpool.trainer.loop import Method, TrainLoop
from skillpool.trainer.lora_train import add_lora
from tests.lora.test_adapter import tiny_llama
from tests.trainer.test_loop import SCHEDULE, examples, trainable

BF16 = replace(SCHEDULE, dtype="bfloat16")


def lora_model() -> Any:
    return add_lora(tiny_llama(), 2, 4.0, 0.1, ["q_proj", "v_proj"], seed=0)  # dropout on: the RNG must match too


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters()}


@contextmanager
def never(model: Any, dtype: torch.dtype, on: bool) -> Iterator[int]:
    yield 0


def test_bfloat16_training_with_bfloat16_frozen_weights_is_the_same_training(monkeypatch: pytest.MonkeyPatch) -> None:
    data = examples(9, seed=5)
    torch.manual_seed(0)
    held = lora_model()
    TrainLoop(Method(held), data, 0, BF16).run()
    monkeypatch.setattr(loop_module, "frozen_linears_in", never)
    torch.manual_seed(0)
    cast_each_time = lora_model()
    TrainLoop(Method(cast_each_time), data, 0, BF16).run()
    a, b = trainable(held), trainable(cast_each_time)
    assert a.keys() == b.keys() and a
    start = trainable(lora_model())
    assert any(not torch.equal(a[k], start[k]) for k in a)  # it trained
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_only_frozen_linears_are_held_in_bfloat16_during_the_run_and_the_float32_ones_come_back() -> None:
    model = lora_model()
    inner = model.get_base_model()
    before = weights(model)
    seen: dict[str, torch.dtype] = {}

    def record(module: nn.Module, args: Any) -> None:
        for name, p in weights(model).items():
            seen.setdefault(name, p.dtype)

    handle = inner.model.layers[0].register_forward_pre_hook(record)
    try:
        TrainLoop(Method(model), examples(6), 0, BF16).run()
    finally:
        handle.remove()
    frozen_linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    frozen_linear = {n for n in frozen_linear if not before[n].requires_grad and "lm_head" not in n}
    assert frozen_linear and any("mlp" in n for n in frozen_linear) and any("base_layer" in n for n in frozen_linear)
    for name, dtype in seen.items():
        assert dtype == (torch.bfloat16 if name in frozen_linear else torch.float32), name
    after = weights(model)
    assert after.keys() == before.keys()
    assert all(after[n] is before[n] for n in before)  # the very float32 parameters, not casts back


def test_the_block_leaves_float32_runs_and_a_failing_run_as_they_were() -> None:
    model = lora_model()
    inner = model.get_base_model()
    before = weights(model)
    with frozen_linears_in(inner, torch.bfloat16, on=False) as n:
        assert n == 0
        assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(RuntimeError, match="mid-run"), frozen_linears_in(inner, torch.bfloat16, on=True) as n:
        assert n > 0
        raise RuntimeError("mid-run")
    assert all(weights(model)[k] is p for k, p in before.items())
