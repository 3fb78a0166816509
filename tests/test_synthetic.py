"""The benchmarks' synthetic models and skills (tests/synthetic.py): a config-only LLaMA folder that transformers
builds with SmolLM2's tokenizer, and random LoRA skills of its shape, saved as PEFT folders and into a skill store
that gives them back unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from skillpool.lora.adapter import LoRAAdapter, load_peft_adapter
from skillpool.runtime.base_model import WEIGHT_SUFFIXES, BaseModel
from tests.synthetic import attention_shapes, dummy_model, random_skills, save_peft, write_store

# grouped-query attention, so k and v differ from q in width
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def assert_same(a: LoRAAdapter, b: LoRAAdapter) -> None:
    assert a.modules.keys() == b.modules.keys()
    for name, block in a.modules.items():
        assert torch.equal(block.A, b.modules[name].A) and torch.equal(block.B, b.modules[name].B), name
        assert block.scaling == pytest.approx(b.modules[name].scaling)


def test_the_dummy_model_is_a_llama_of_the_shape_with_the_base_tokenizer_and_no_weights(
    smollm: BaseModel, tmp_path: Path
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = dummy_model(tmp_path / "tiny-dummy", SHAPE, "float32")
    base = json.loads((smollm.path / "config.json").read_text())
    config = AutoConfig.from_pretrained(str(folder))
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 64, 2)
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (
        base["vocab_size"],
        base["bos_token_id"],
        base["eos_token_id"],
    )
    assert not any(f.suffix in WEIGHT_SUFFIXES for f in folder.iterdir())
    assert not (folder / "generation_config.json").exists()  # no server takes sampling defaults from it
    tok = AutoTokenizer.from_pretrained(str(folder))
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert max(tok(chat)["input_ids"]) < config.vocab_size
    model = AutoModelForCausalLM.from_config(config)
    for name, (d_in, d_out) in attention_shapes(json.loads((folder / "config.json").read_text())).items():
        layer = model.get_submodule(name)
        assert (layer.in_features, layer.out_features) == (d_in, d_out), name
    own_vocab = dummy_model(tmp_path / "small-vocab", {**SHAPE, "vocab_size": 1000}, "float32")
    assert json.loads((own_vocab / "config.json").read_text())["vocab_size"] == 1000  # the shape's own wins


def test_random_skills_are_reproducible_per_seed_and_scaled_by_alpha() -> None:
    first = list(random_skills(SHAPE, 2, 4, seed=0, alpha=8.0))
    again = list(random_skills(SHAPE, 2, 4, seed=0, alpha=8.0))
    other = list(random_skills(SHAPE, 2, 4, seed=1))
    assert [name for name, _ in first] == ["skill-0000", "skill-0001"]
    for (_, a), (_, b) in zip(first, again):
        assert_same(a, b)
    shapes = attention_shapes(SHAPE)
    assert shapes["model.layers.1.self_attn.k_proj"] == (64, 32)
    for _, adapter in first:
        assert adapter.modules.keys() == shapes.keys()
        for name, block in adapter.modules.items():
            assert block.A.shape == (4, shapes[name][0]) and block.B.shape == (shapes[name][1], 4)
            assert block.scaling == 2.0
    q = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(first[0][1].modules[q].A, first[1][1].modules[q].A)
    assert not torch.equal(first[0][1].modules[q].A, other[0][1].modules[q].A)
    assert other[0][1].modules[q].scaling == 1.0  # alpha defaults to the rank


def test_peft_folders_load_back_as_the_same_skills(tmp_path: Path) -> None:
    skills = list(random_skills(SHAPE, 2, 8, alpha=16.0))
    paths = save_peft(skills, tmp_path / "adapters", "tiny-dummy")
    assert [p.name for p in paths] == [name for name, _ in skills]
    for (_, adapter), path in zip(skills, paths):
        assert json.loads((path / "adapter_config.json").read_text())["lora_alpha"] == 16.0
        assert_same(load_peft_adapter(path), adapter)


def test_the_store_holds_the_skills_on_the_model_with_router_keys(tmp_path: Path) -> None:
    from skillpool.adapters_store.store import SkillStore

    model = dummy_model(tmp_path / "tiny-dummy", SHAPE, "float32")
    names = write_store(tmp_path / "data", random_skills(SHAPE, 2, 4), model)
    assert names == ["skill-0000", "skill-0001"]
    store = SkillStore(tmp_path / "data")
    assert [r.name for r in store.list_latest()] == names
    for name, adapter in random_skills(SHAPE, 2, 4):
        record = store.get(name)
        assert record is not None and record.meta["base_model"]["id"] == "tiny-dummy"
        assert_same(record.adapter(), adapter)
        keys = record.router_tensors()
        assert keys["centroid_keys"].shape[-1] == 384  # MiniLM's width
