"""The method registry (known names, a clear error for others, which router each needs) and every method
training a block on the tiny random LLaMA through the one interface."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from skillpool.adapters_store.store import SkillStore
from skillpool.lora.adapter import load_peft_adapter
from skillpool.router import Router, RouterSettings, SAPTSettings, TokenPooler
from skillpool.trainer.config import METHODS, TrainConfig
from skillpool.trainer.loop import Progress
from skillpool.trainer.methods import METHOD_CLASSES, BlockJob, method_class, method_error, method_for
from tests.trainer.test_skill_trainer_kif import examples

CFG = TrainConfig(epochs=1.0, batch_size=4, max_seq_len=64, target_modules=["q_proj", "v_proj"])


def test_the_registry_knows_every_method_by_name() -> None:
    assert tuple(METHOD_CLASSES) == METHODS == ("isolated", "sapt", "kif")
    for name in METHODS:
        assert method_class(name).name == name and method_for(name).name == name
        assert method_error(name, "sapt") is None  # a sapt router takes every method


def test_an_unknown_method_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="method must be one of isolated, sapt, kif, got 'lora'"):
        method_for("lora")
    assert method_error("lora", "dtkr") == "method must be one of isolated, sapt, kif, got 'lora'"


def test_only_sapt_needs_a_sapt_router() -> None:
    assert method_error("isolated", "dtkr") is None and method_error("kif", "centroid") is None
    error = method_error("sapt", "dtkr")
    assert error is not None and "routes with 'dtkr'" in error and "--router-mode sapt" in error


@pytest.mark.parametrize("name", METHODS)
def test_each_method_trains_a_block_on_the_tiny_llama(name: str, tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    settings = RouterSettings(mode="sapt", sapt=SAPTSettings(steps=5)) if name == "sapt" else RouterSettings()
    pooler = TokenPooler.from_checkpoint(tiny_base.path) if name == "sapt" else None
    router = Router(embedder, settings, pooler)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_base.path), dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = examples("sst-2", 12)
    seen: list[Progress] = []
    folder = tmp_path / "block"
    folder.mkdir()
    job = BlockJob(
        name=name,
        train=rows[:8],
        held=rows[8:],
        cfg=CFG,
        model=model,
        tok=AutoTokenizer.from_pretrained(str(tiny_base.path)),
        folder=folder,
        base_model_id=tiny_base.model_id,
        store=SkillStore(tmp_path / "store"),
        router=router,
        on_progress=seen.append,
        should_stop=None,
        check=lambda: None,
    )
    block = method_for(name).train(job)

    assert [p.step for p in seen] == [1, 2] and all(p.total == 2 for p in seen)  # 8 rows at batch size 4
    adapter = load_peft_adapter(folder)  # plain PEFT files, as the store keeps them
    assert {p.rsplit(".", 1)[1] for p in adapter.modules} == {"q_proj", "v_proj"}
    assert any(float(f.B.abs().sum()) > 0 for f in adapter.modules.values())  # it learned something
    # the base model comes back plain and unchanged, for the gate to generate with
    after: dict[str, Any] = block.model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    if name == "sapt":  # its key and the projector, learned with the block
        assert int(block.router_tensors["sapt_blocks"][0]) == 1 and block.attention == {"sapt": 1.0}
    else:
        assert block.router_tensors == {} and block.attention is None
    assert block.training == ({"kif": block.training["kif"]} if name == "kif" else {})
    if name == "kif":  # nothing earlier: a fresh start and an empty memory
        assert block.training["kif"]["init_from"] == {} and block.training["kif"]["memory_examples"] == 0
