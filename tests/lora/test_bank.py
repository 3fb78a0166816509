"""Serving's bank: per-row gathered blocks (LoRABank), in either batch layout, must equal merging each row's
weighted delta into the base weights."""

from __future__ import annotations

import copy

import pytest
import torch

from skillpool.lora.adapter import mix_delta
from skillpool.lora.bank import LoRABank
from skillpool.lora.batch_plans import shared_is_cheaper
from tests.lora.test_adapter import merged_copy, random_adapter, tiny_llama


def test_mixed_forward_equals_merged_weights_with_different_ranks() -> None:
    model = tiny_llama()
    a1, a2 = random_adapter(model, rank=4, alpha=8, seed=1), random_adapter(model, rank=8, alpha=4, seed=2)
    x = torch.randint(0, 97, (1, 7))
    ref = merged_copy(model, [(a1, 0.3), (a2, 0.7)])
    bank = LoRABank(model)
    bank.add("one", a1)
    bank.add("two", a2)
    with torch.no_grad():
        want = ref(x).logits
        with bank.mixed([[("one", 0.3), ("two", 0.7)]]):
            got = model(x).logits
        base = model(x).logits  # the context restores the plain base model
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(base, want, atol=1e-3)


def test_each_row_of_a_batch_gets_its_own_mix() -> None:
    model = tiny_llama()
    a1, a2 = random_adapter(model, 4, 8, seed=3), random_adapter(model, 2, 2, seed=4, targets=("q_proj",))
    bank = LoRABank(model)
    bank.add("one", a1)
    bank.add("two", a2)
    mixes = [[("one", 1.0)], [], [("one", 0.5), ("two", 0.5)], [("two", 1.0)]]
    x = torch.randint(0, 97, (4, 6))
    with torch.no_grad(), bank.mixed(mixes):
        batched = model(x).logits
    with torch.no_grad():
        for i, mix in enumerate(mixes):
            with bank.mixed([mix]):
                single = model(x[i : i + 1]).logits
            assert torch.allclose(batched[i], single[0], atol=1e-4), f"row {i} differs"
        # Row 2 also equals the merged reference (a2 only touches q_proj, so merge per module).
        # The copy's MixedLoRALinear wrappers have no active mix: they act as their base Linear.
        ref = copy.deepcopy(model)
        for path in a1.modules:
            blocks = [(a.modules[path], 0.5) for a in (a1, a2) if path in a.modules]
            ref.get_submodule(path).base.weight.data += mix_delta(blocks)
        assert torch.allclose(ref(x[2:3]).logits[0], batched[2], atol=1e-4)


def test_packed_siblings_share_one_down_projection_and_stay_exact_on_other_inputs() -> None:
    """q, k and v read the same input, so their A's run as one bmm; a sibling fed another tensor must not
    reuse that product (the guard is the input itself, not the call order)."""
    model = tiny_llama()
    a1 = random_adapter(model, 4, 8, seed=5, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    a2 = random_adapter(model, 2, 2, seed=6, targets=("q_proj", "v_proj"))  # k gets a's block only
    bank = LoRABank(model)
    bank.add("one", a1)
    bank.add("two", a2)
    mixes = [[("one", 0.6), ("two", 0.4)], [("two", 1.0)]]
    attn = model.model.layers[0].self_attn
    x, other = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    with torch.no_grad(), bank.mixed(mixes):
        plans = [attn.q_proj.plan, attn.k_proj.plan, attn.v_proj.plan]
        assert plans[0].shared is not None and all(p.shared is plans[0].shared for p in plans)
        assert attn.o_proj.plan.shared is None  # o reads the attention output: its own bmm
        got = {"q_proj": attn.q_proj(x), "k_proj": attn.k_proj(other), "v_proj": attn.v_proj(x)}
    prefix = "model.layers.0.self_attn."
    for name, out in got.items():
        inp, layer = (other if name == "k_proj" else x), getattr(attn, name).base
        for row, mix in enumerate(mixes):
            adapters = [({"one": a1, "two": a2}[s], w) for s, w in mix]
            blocks = [(a.modules[prefix + name], w) for a, w in adapters if prefix + name in a.modules]
            want = inp[row] @ (layer.weight + mix_delta(blocks)).T if blocks else layer(inp[row])
            assert torch.allclose(out[row], want, atol=1e-5), f"{name} row {row}"


def test_shared_union_blocks_equal_per_row_blocks() -> None:
    """Many rows of different mixes over few skills run on the union's blocks shared by every row (decode); the
    same batch with long rows runs per-row blocks (prefill). Both layouts give every row its own mix."""
    model = tiny_llama()
    adapters = {
        "one": random_adapter(model, 4, 8, seed=7),
        "two": random_adapter(model, 2, 2, seed=8, targets=("q_proj",)),
        "three": random_adapter(model, 8, 16, seed=9, targets=("q_proj", "v_proj", "o_proj")),
        "four": random_adapter(model, 4, 4, seed=10),
    }
    bank = LoRABank(model)
    for name, a in adapters.items():
        bank.add(name, a)
    mixes = [
        [("one", 0.5), ("two", 0.3), ("three", 0.2)],
        [("three", 1.0)],
        [],
        [("two", 0.6), ("one", 0.4)],
        [("one", 0.2), ("three", 0.8)],
        [("three", 0.5), ("two", 0.25), ("four", 0.25)],
    ]
    assert shared_is_cheaper(len(mixes), 3, 4, tokens=1) and not shared_is_cheaper(len(mixes), 3, 4, tokens=64)
    assert not shared_is_cheaper(1, 3, 3, tokens=1)  # one row: its union is its own blocks
    x = torch.randint(0, 97, (len(mixes), 5))
    q = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        with bank.mixed(mixes, tokens=1):
            assert q.plan.A.dim() == 2  # (U * r, in): one set of blocks for every row
            shared = model(x).logits
        with bank.mixed(mixes, tokens=64):
            assert q.plan.A.dim() == 3  # (rows, k * r, in): each row's own blocks
            per_row = model(x).logits
        assert torch.allclose(shared, per_row, atol=1e-4)
        for i, mix in enumerate(mixes):
            with bank.mixed([mix]):
                single = model(x[i : i + 1]).logits
            assert torch.allclose(shared[i], single[0], atol=1e-4), f"row {i} differs"
        base = model(x).logits
        with bank.mixed([[("one", 0.0)]] * len(mixes)):  # zero weights only: no blocks at all
            assert q.plan is None
            zero = model(x).logits
    assert torch.allclose(shared[2], base[2], atol=1e-5)  # the empty mix is the base model
    assert torch.equal(zero, base)
    assert not torch.allclose(shared[0], base[0], atol=1e-3)


def test_unknown_skill_in_mix_is_an_error() -> None:
    bank = LoRABank(tiny_llama())
    with pytest.raises(KeyError):
        with bank.mixed([[("missing", 1.0)]]):
            pass
