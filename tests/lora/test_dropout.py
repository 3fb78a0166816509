"""LoRA dropout from 16-bit uniforms: dropout's distribution (rate, scale, expectation, independence between the
four uniforms of a word), seeded masks, gradients through the mask, and PEFT's LoRA layers using it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from skillpool.lora.dropout import LEVELS, Dropout, dropout, use_fast_dropout
from skillpool.trainer.lora_train import add_lora
from tests.lora.test_adapter import tiny_llama


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_drops_each_element_at_rate_p_and_keeps_the_expectation(p: float) -> None:
    torch.manual_seed(0)
    x = torch.rand(1 << 20) + 0.5  # positive, so a kept element is never zero
    y = dropout(x, p)
    dropped = y == 0
    n = x.numel()
    sigma = math.sqrt(p * (1 - p) / (n / 4))
    for lane in range(4):  # every 16-bit part of the 64-bit words is a uniform of its own
        rate = float(dropped[lane::4].float().mean())
        assert abs(rate - p) < 5 * sigma, (lane, rate)
    drop = round(p * LEVELS)
    scale = LEVELS / (LEVELS - drop)
    assert torch.allclose(y[~dropped], x[~dropped] * scale)
    # neighbours are independent: both dropped about p² of the time
    both = float((dropped[1:] & dropped[:-1]).float().mean())
    assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n) + 1e-4
    assert abs(float(y.mean()) - float(x.mean())) < 0.01


def test_masks_follow_torch_seed_and_the_shape_of_the_input() -> None:
    x = torch.ones(3, 7, 5)  # 105 elements: not a multiple of four
    torch.manual_seed(1)
    a = dropout(x, 0.3)
    torch.manual_seed(1)
    b = dropout(x, 0.3)
    c = dropout(x, 0.3)
    assert a.shape == x.shape and torch.equal(a, b)
    assert not torch.equal(a, c)


def test_off_in_eval_at_zero_and_everything_at_one() -> None:
    x = torch.randn(4, 8)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        dropout(x, 1.5)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        dropout(x, float("nan"))


def test_gradient_flows_through_the_kept_elements_only() -> None:
    torch.manual_seed(2)
    x = torch.randn(64, 32, requires_grad=True)
    y = dropout(x, 0.25)
    y.sum().backward()
    assert x.grad is not None
    kept = y.detach() != 0
    drop = round(0.25 * LEVELS)
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], LEVELS / (LEVELS - drop)))
    assert torch.equal(x.grad[~kept], torch.zeros_like(x.grad[~kept]))


def test_bfloat16_inputs_stay_bfloat16() -> None:
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    assert dropout(x, 0.1).dtype == torch.bfloat16


def test_peft_lora_layers_train_with_it_and_evaluate_without_it() -> None:
    model = add_lora(tiny_llama(), 2, 4.0, 0.2, ["q_proj", "v_proj"], seed=0)
    layers = [m for m in model.modules() if isinstance(getattr(m, "lora_dropout", None), nn.ModuleDict)]
    assert layers
    for layer in layers:
        assert all(type(d) is Dropout and d.p == 0.2 for d in layer.lora_dropout.values())
    assert use_fast_dropout(model) == 0  # already replaced
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    model.eval()
    with torch.no_grad():
        first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert torch.equal(first, second)


def test_no_dropout_leaves_peft_identity_layers_alone() -> None:
    model = add_lora(tiny_llama(), 2, 4.0, 0.0, ["q_proj"], seed=0)
    kinds = {type(d) for m in model.modules() for d in getattr(m, "lora_dropout", {}).values()}
    assert kinds == {nn.Identity}
