"""Training's weighted blocks (weighted_mix) must equal merging each row's weighted delta into the base weights,
give the gradients the dense mix gives to the mix weights and the trainable block, and share a served model's
mixed layers."""

from __future__ import annotations

import copy

import torch
from torch import nn

from skillpool.lora.adapter import LoRAAdapter, LoRAFactors, mix_delta
from skillpool.lora.bank import LoRABank
from skillpool.lora.mixed_layer import MixedLoRALinear
from skillpool.lora.training_mix import weighted_mix
from tests.lora.test_adapter import random_adapter, tiny_llama


def test_weighted_mix_equals_the_dense_mix_per_row() -> None:
    model = tiny_llama()
    a1, a2 = random_adapter(model, 4, 8, seed=1), random_adapter(model, 2, 2, seed=2, targets=("q_proj",))
    weights = torch.tensor([[0.3, 0.7], [0.9, 0.1]])
    x = torch.randint(0, 97, (2, 6))
    with torch.no_grad(), weighted_mix(model, [a1, a2]) as mix:
        assert all(isinstance(model.get_submodule(p), MixedLoRALinear) for p in a1.modules)
        mix.set_weights(weights)
        got = model(x).logits
    assert not any(isinstance(m, MixedLoRALinear) for m in model.modules())  # restored on exit
    for b in range(2):  # each row against W + Σ w_i s_i B_i A_i merged by hand (a2 only has q_proj)
        ref = copy.deepcopy(model)
        for path in a1.modules:
            blocks = [(a.modules[path], float(weights[b, i])) for i, a in enumerate((a1, a2)) if path in a.modules]
            layer = ref.get_submodule(path)
            assert isinstance(layer, torch.nn.Linear)
            layer.weight.data += mix_delta(blocks)
        with torch.no_grad():
            want = ref(x[b : b + 1]).logits[0]
        assert torch.allclose(got[b], want, atol=1e-4), f"row {b}"
    with torch.no_grad():
        assert not torch.allclose(model(x).logits, got, atol=1e-3)  # the mix mattered
    w = weights.clone().requires_grad_()
    with weighted_mix(model, [a1, a2]) as mix:
        mix.set_weights(w)
        model(x).logits.square().mean().backward()
    assert w.grad is not None and (w.grad != 0).all()  # the router learns from the LM loss through w


def test_weighted_blocks_gradients_equal_the_dense_mix() -> None:
    """Training path on one Linear: output and gradients (mix weights, new block's A and B) against
    y_b = W x_b + Σ_i w[b, i] · s_i · B_i A_i x_b written densely, with ranks that differ per block."""
    g = torch.Generator().manual_seed(0)
    holder = nn.Module()
    holder.proj = nn.Linear(8, 6)
    frozen = LoRAFactors(torch.randn(2, 8, generator=g), torch.randn(6, 2, generator=g), 1.5)
    A, B = nn.Parameter(torch.randn(3, 8, generator=g)), nn.Parameter(torch.randn(6, 3, generator=g))
    logits = torch.randn(4, 2, generator=g, requires_grad=True)
    x = torch.randn(4, 5, 8, generator=g)
    with weighted_mix(holder, [LoRAAdapter({"proj": frozen}), LoRAAdapter({"proj": LoRAFactors(A, B, 0.5)})]) as mix:
        assert isinstance(holder.proj, MixedLoRALinear)
        mix.set_weights(logits.softmax(-1))
        got = holder.proj(x)
        grads = torch.autograd.grad(got.square().sum(), [logits, A, B])
        mix.set_weights(None)
        assert torch.equal(holder.proj(x), holder.proj.base(x))  # no weights: the base layer alone
    assert isinstance(holder.proj, nn.Linear)  # the plain Linear is back
    w = logits.softmax(-1)
    delta = w[:, 0, None, None] * 1.5 * (frozen.B @ frozen.A) + w[:, 1, None, None] * 0.5 * (B @ A)  # (4, 6, 8)
    want = holder.proj(x) + torch.einsum("bti,boi->bto", x, delta)
    wants = torch.autograd.grad(want.square().sum(), [logits, A, B])
    assert torch.allclose(got, want, atol=1e-5)
    for name, a, b in zip(("weights", "A", "B"), grads, wants):
        assert b.abs().sum() > 0 and torch.allclose(a, b, rtol=1e-4, atol=1e-4), name


def test_training_mix_reuses_a_served_models_layers() -> None:
    """One layer for both: weighted_mix on a model the bank serves uses the bank's MixedLoRALinears, gives the
    served output for the same per-row mixes, and leaves the bank's layers and plans as they were."""
    model = tiny_llama()
    a1, a2 = random_adapter(model, 4, 8, seed=6), random_adapter(model, 2, 2, seed=7)
    bank = LoRABank(model)
    bank.add("one", a1)
    bank.add("two", a2)
    layers = {p: model.get_submodule(p) for p in a1.modules}
    weights = torch.tensor([[0.2, 0.8], [1.0, 0.0], [0.5, 0.5]])
    x = torch.randint(0, 97, (3, 6))
    with torch.no_grad():
        bank.activate([[("one", float(r[0])), ("two", float(r[1]))] for r in weights])
        served = model(x).logits
        plans = {p: layer.plan for p, layer in layers.items()}
        with weighted_mix(model, [a1, a2]) as mix:
            assert all(model.get_submodule(p) is layer for p, layer in layers.items())
            mix.set_weights(weights)
            trained = model(x).logits
        assert all(model.get_submodule(p) is layer and layer.plan is plans[p] for p, layer in layers.items())
        assert torch.equal(model(x).logits, served)  # the bank's mix is active again
        bank.deactivate()
        assert not torch.allclose(model(x).logits, served, atol=1e-3)  # the mix mattered
    assert torch.allclose(trained, served, atol=1e-4)
