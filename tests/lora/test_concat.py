"""A mix as one concatenated LoRA (for vLLM) carries exactly the mix's delta (its PEFT folder: test_vllm_adapters.py)."""

from __future__ import annotations

import pytest
import torch

from skillpool.lora.adapter import LoRAAdapter, LoRAFactors, mix_delta
from skillpool.lora.concat import concat_mix, zero_adapter

from .test_adapter import random_adapter, tiny_llama


def three_skills() -> tuple[torch.nn.Module, list[tuple[LoRAAdapter, float]]]:
    model = tiny_llama()
    a = random_adapter(model, rank=4, alpha=8, seed=1)
    b = random_adapter(model, rank=2, alpha=16, seed=2, targets=("q_proj", "v_proj"))  # fewer modules
    c = random_adapter(model, rank=8, alpha=4, seed=3)
    return model, [(a, 0.5), (b, 0.3125), (c, 0.1875)]


def test_concatenated_adapter_equals_dense_weighted_sum() -> None:
    _, mix = three_skills()
    cat = concat_mix(mix)
    for path, f in cat.modules.items():
        assert f.rank == 4 + 2 + 8 and f.scaling == 1.0
        dense = mix_delta([(a.modules[path], w) for a, w in mix if path in a.modules])
        torch.testing.assert_close(f.delta(), dense, rtol=1e-5, atol=1e-6)
    assert set(cat.modules) == {p for a, _ in mix for p in a.modules}


def test_zero_adapter_has_zero_delta_and_bad_input_is_refused() -> None:
    model = tiny_llama()
    z = zero_adapter(random_adapter(model, rank=2, alpha=2, seed=7))
    for f in z.modules.values():
        assert f.rank == 1 and not f.delta().any()
    with pytest.raises(ValueError):
        concat_mix([])
    a = LoRAAdapter({"m": LoRAFactors(torch.ones(1, 3), torch.ones(2, 1), 1.0)})
    b = LoRAAdapter({"m": LoRAFactors(torch.ones(1, 4), torch.ones(2, 1), 1.0)})
    with pytest.raises(ValueError, match="disagree"):
        concat_mix([(a, 0.5), (b, 0.5)])
