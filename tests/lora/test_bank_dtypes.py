"""A bank whose blocks are float32 under a bfloat16 model (the hf engine on a CPU): each row's mix is computed in
float32 and added to the bfloat16 base output, in both batch layouts, and answers as the merged weights do."""

from __future__ import annotations

import copy

import pytest
import torch

from skillpool.lora.bank import LoRABank
from tests.lora.test_adapter import merged_copy, random_adapter, tiny_llama


@pytest.mark.parametrize("rows", [1, 6])  # one row: per-row blocks; six rows over two skills: shared blocks
def test_float32_blocks_under_a_bfloat16_model_equal_the_merged_weights(rows: int) -> None:
    model = tiny_llama()
    a1, a2 = random_adapter(model, 4, 8, seed=1), random_adapter(model, 8, 4, seed=2)
    mixes = [[("one", 0.3), ("two", 0.7)], [("one", 1.0)], [], [("two", 1.0)], [("one", 0.5), ("two", 0.5)], []]
    x = torch.randint(0, 97, (rows, 5))
    want = []
    with torch.no_grad():
        for i in range(rows):
            ref = merged_copy(model, [(a1 if s == "one" else a2, w) for s, w in mixes[i]]) if mixes[i] else model
            want.append(ref(x[i : i + 1]).logits[0])
    half = copy.deepcopy(model).to(torch.bfloat16)
    bank = LoRABank(half, torch.float32)
    bank.add("one", a1)
    bank.add("two", a2)
    assert all(s.A.dtype == s.Bt.dtype == torch.float32 for s in bank.stacks.values())
    with torch.no_grad(), bank.mixed(mixes[:rows], tokens=1):
        got = half(x).logits
        layer = next(s.layer for s in bank.stacks.values())
        assert (
            layer.plan is not None
            and layer(torch.randn(rows, 1, layer.base.in_features).bfloat16()).dtype == torch.bfloat16
        )
    assert got.dtype == torch.bfloat16
    for i in range(rows):  # to bfloat16's precision: its weights and activations round to 8 bits of mantissa
        assert torch.allclose(got[i].float(), want[i], atol=0.05 * float(want[i].abs().max())), i
    with torch.no_grad():
        plain = half(x).logits
    changed = [i for i in range(rows) if mixes[i]]
    assert all(not torch.allclose(plain[i], got[i]) for i in changed)  # the context restores the base model
