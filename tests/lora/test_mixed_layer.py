"""The one mixed layer: only a Linear can carry it, and a refused swap leaves the model as it was."""

from __future__ import annotations

import pytest
import torch

from skillpool.lora.adapter import LoRAAdapter, LoRAFactors, UnsupportedAdapter
from skillpool.lora.mixed_layer import MixedLoRALinear
from skillpool.lora.training_mix import weighted_mix
from tests.lora.test_adapter import tiny_llama


def test_a_non_linear_target_is_unsupported() -> None:
    model = tiny_llama()
    f = LoRAFactors(torch.zeros(1, 32), torch.zeros(32, 1), 1.0)
    bogus = LoRAAdapter({"model.layers.0.self_attn.q_proj": f, "model.layers.1.self_attn": f})  # a Linear, then not
    with pytest.raises(UnsupportedAdapter, match="not a Linear"), weighted_mix(model, [bogus]):
        pass
    assert not any(isinstance(m, MixedLoRALinear) for m in model.modules())  # the Linear swapped first is back
