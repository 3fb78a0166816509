"""A PEFT LoRA made by PEFT itself passes the checks and is written back with the same delta PEFT computes; every
adapter that could not serve as a skill of this base model is refused, naming what is wrong."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from skillpool.lora.adapter import AdapterRejected, load_peft_adapter
from skillpool.lora.peft_archive import read_folder
from skillpool.lora.peft_checks import check_peft_files
from tests.lora.test_adapter import tiny_llama


def linears(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def peft_files(model: nn.Module, folder: Path, **lora: object) -> dict[str, bytes]:
    """A PEFT LoRA on `model` with random B (PEFT starts B at zero), saved by PEFT and read back as its files."""
    from peft import LoraConfig, get_peft_model

    kw = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **lora}
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(**kw))  # type: ignore[arg-type]
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(folder)
    return read_folder(folder, 10**8)


def refused(code: str, files: dict[str, bytes], model: nn.Module, max_rank: int = 256) -> str:
    with pytest.raises(AdapterRejected) as e:
        check_peft_files(files, linears(model), max_rank, "tiny")
    assert e.value.code == code, str(e.value)
    return str(e.value)


def with_config(files: dict[str, bytes], **changes: object) -> dict[str, bytes]:
    config = json.loads(files["adapter_config.json"])
    return {**files, "adapter_config.json": json.dumps({**config, **changes}).encode()}


def with_tensors(files: dict[str, bytes], change) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    from safetensors.torch import load

    tensors = load(files["adapter_model.safetensors"])
    change(tensors)
    return {**files, "adapter_model.safetensors": save(tensors)}


@pytest.mark.parametrize("rslora", [False, True])
def test_a_peft_lora_passes_and_is_written_back_with_peft_s_delta(tmp_path: Path, rslora: bool) -> None:
    from peft import PeftModel

    model = tiny_llama()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    files = peft_files(model, tmp_path / "peft", r=4, lora_alpha=16, use_rslora=rslora, target_modules=targets)
    checked = check_peft_files(files, linears(model), 256, "tiny")
    assert (checked.rank, checked.alpha, checked.use_rslora) == (4, 16.0, rslora)
    assert checked.adapter.modules["model.layers.0.self_attn.q_proj"].scaling == (16 / 2 if rslora else 16 / 4)
    checked.save(tmp_path / "ours", "tiny")
    x = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        want = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "peft").eval()(x).logits
        got = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "ours").eval()(x).logits
    assert torch.equal(got, want)  # the same tensors, r, alpha and rsLoRA: the same forward, bit for bit
    back = load_peft_adapter(tmp_path / "ours")
    for path, f in checked.adapter.modules.items():
        assert torch.equal(back.modules[path].A, f.A) and torch.equal(back.modules[path].B, f.B)
        assert math.isclose(back.modules[path].scaling, f.scaling)


def test_an_alpha_pattern_that_gives_every_module_one_scaling_is_kept(tmp_path: Path) -> None:
    model = tiny_llama()
    files = peft_files(model, tmp_path, r=4, lora_alpha=8, alpha_pattern={"q_proj": 12, "v_proj": 12})
    checked = check_peft_files(files, linears(model), 256, "tiny")
    assert checked.adapter.modules["model.layers.1.self_attn.v_proj"].scaling == 3.0 and checked.alpha == 12.0
    refused("adapter_mixed_ranks", with_config(files, alpha_pattern={"q_proj": 12}), model)


def test_adapters_for_another_model_or_architecture_are_refused(tmp_path: Path) -> None:
    model = tiny_llama()
    config = model.config.to_dict()
    wider = type(model)(type(model.config)(**{**config, "hidden_size": 48}))
    message = refused("adapter_base_mismatch", peft_files(wider, tmp_path / "wide"), model)
    assert "another base model" in message and "(4, 48)" in message
    deeper = type(model)(type(model.config)(**{**config, "num_hidden_layers": 3}))
    message = refused("adapter_base_mismatch", peft_files(deeper, tmp_path / "deep"), model)
    assert "model.layers.2.self_attn.q_proj" in message
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97))
    message = refused("adapter_base_mismatch", peft_files(gpt2, tmp_path / "gpt2", target_modules=["c_attn"]), model)
    assert "c_attn" in message and "another architecture" in message


def test_unsupported_modules_ranks_and_features_are_refused(tmp_path: Path) -> None:
    model = tiny_llama()
    assert "lm_head" in refused(
        "adapter_unsupported_module", peft_files(model, tmp_path / "h", target_modules=["lm_head"]), model
    )
    big = peft_files(model, tmp_path / "r", r=16)
    assert "rank 16" in refused("adapter_rank_too_large", big, model, max_rank=8)
    files = peft_files(model, tmp_path / "ok")
    for field, value in [
        ("use_dora", True),
        ("modules_to_save", ["lm_head"]),
        ("lora_bias", True),
        ("init_lora_weights", "pissa"),
        ("layer_replication", [[0, 1]]),
        ("trainable_token_indices", [1, 2]),
        ("some_future_field", {"on": True}),
    ]:
        assert field in refused("adapter_unsupported_feature", with_config(files, **{field: value}), model)
    assert "bias" in refused("adapter_unsupported_feature", with_config(files, bias="all"), model)
    refused("adapter_not_lora", with_config(files, peft_type="IA3"), model)
    refused("invalid_adapter_config", with_config(files, lora_alpha=float("nan")), model)
    refused("invalid_adapter_config", {**files, "adapter_config.json": b"[1, 2]"}, model)
    refused("invalid_adapter_weights", with_config(files, r=8), model)  # the tensors say 4
    refused("adapter_mixed_ranks", peft_files(model, tmp_path / "p", rank_pattern={"q_proj": 2}), model)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path: Path, bad: float) -> None:
    model = tiny_llama()
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"

    def poison(t: dict[str, torch.Tensor]) -> None:
        t[key][3, 1] = bad

    assert key in refused("adapter_not_finite", with_tensors(peft_files(model, tmp_path), poison), model)


def test_weights_that_are_not_lora_blocks_are_refused(tmp_path: Path) -> None:
    model = tiny_llama()
    files = peft_files(model, tmp_path)
    refused("invalid_adapter_weights", {**files, "adapter_model.safetensors": b"\x80\x04 a pickle"}, model)
    extra = with_tensors(files, lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(97, 32)}))
    assert "lm_head.weight" in refused("adapter_unsupported_feature", extra, model)
    half = with_tensors(files, lambda t: t.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"))
    assert "lora_B" in refused("invalid_adapter_weights", half, model)
    ints = with_tensors(files, lambda t: t.update({k: v.to(torch.int32) for k, v in t.items()}))
    refused("invalid_adapter_weights", ints, model)
