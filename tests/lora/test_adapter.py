"""LoRA factors and PEFT files: the dense mix reference, and adapters that load back (here and in PEFT) as they were."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from skillpool.lora.adapter import LoRAAdapter, LoRAFactors, load_peft_adapter, mix_delta, save_peft_adapter
from skillpool.lora.bank import LoRABank

TARGETS = ("q_proj", "v_proj", "o_proj")


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def random_adapter(
    model: nn.Module, rank: int, alpha: float, seed: int, targets: tuple[str, ...] = TARGETS
) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            A = torch.randn(rank, mod.in_features, generator=g) * 0.2
            B = torch.randn(mod.out_features, rank, generator=g) * 0.2
            modules[name] = LoRAFactors(A=A, B=B, scaling=alpha / rank)
    return LoRAAdapter(modules=modules)


def merged_copy(model: nn.Module, mix: list[tuple[LoRAAdapter, float]]) -> nn.Module:
    ref = copy.deepcopy(model)
    for path in mix[0][0].modules:
        layer = ref.get_submodule(path)
        delta = mix_delta([(a.modules[path], w) for a, w in mix if path in a.modules])
        layer.weight.data += delta
    return ref


def test_mix_delta_is_weighted_sum_of_products() -> None:
    f1 = LoRAFactors(torch.randn(2, 5), torch.randn(3, 2), 2.0)
    f2 = LoRAFactors(torch.randn(4, 5), torch.randn(3, 4), 0.5)
    got = mix_delta([(f1, 0.25), (f2, 0.75)])
    want = 0.25 * 2.0 * f1.B @ f1.A + 0.75 * 0.5 * f2.B @ f2.A
    assert torch.allclose(got, want, atol=1e-6)
    # Averaging A and B separately (the cross-term bug) gives something else.
    assert got.shape == (3, 5)


def test_peft_adapter_round_trip_matches_peft_forward(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from peft import LoraConfig, PeftModel, get_peft_model

    model = tiny_llama()
    peft_model = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(tmp_path)
    x = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        want = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path).eval()(x).logits
    adapter = load_peft_adapter(tmp_path)
    assert set(adapter.modules) == {f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")}
    assert next(iter(adapter.modules.values())).scaling == 4.0
    bank = LoRABank(model)
    bank.add("s", adapter)
    with torch.no_grad(), bank.mixed([[("s", 1.0)], [("s", 1.0)]]):
        got = model(x).logits
    assert torch.allclose(got, want, atol=1e-4)


def test_save_peft_adapter_round_trips_and_loads_in_peft(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from peft import PeftModel

    model = tiny_llama()
    adapter = random_adapter(model, rank=4, alpha=8, seed=5)
    save_peft_adapter(adapter, tmp_path, "tiny", alpha=8, target_modules=TARGETS)
    again = load_peft_adapter(tmp_path)
    assert again.modules.keys() == adapter.modules.keys()
    for path, f in adapter.modules.items():
        g = again.modules[path]
        assert torch.equal(g.A, f.A) and torch.equal(g.B, f.B) and g.scaling == f.scaling
    x = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        want = merged_copy(model, [(adapter, 1.0)])(x).logits
        got = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path).eval()(x).logits
        base = model(x).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(base, want, atol=1e-3)  # the delta is not negligible: the check above means something
    with pytest.raises(ValueError, match="scaling"):  # PEFT would load it with alpha / r = 4, not 2
        save_peft_adapter(adapter, tmp_path / "bad", "tiny", alpha=16, target_modules=TARGETS)
