"""An import job's trainer step (SkillTrainer.adopt) as a `skillpool worker` runs it: a private router in sapt mode
and its own judge. The adopted adapter's files are stored as they were checked, its keys learned into the shared
SAPT state, its answered examples gated (QualityGateFailed stores nothing), and without examples it has no keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skillpool.adapters_store.store import SkillStore
from skillpool.lora.adapter import load_peft_adapter
from skillpool.lora.peft_archive import read_folder
from skillpool.lora.peft_checks import check_peft_files
from skillpool.router import Router, RouterSettings, SAPTSettings, TokenPooler
from skillpool.runtime.base_model import linear_shapes
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.datasets import parse_jsonl
from skillpool.trainer.quality import QualityGateFailed
from skillpool.trainer.skill_trainer import SkillTrainer
from tests.peft_adapters import opposite_rows, train_peft


def staged(tiny_base, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    """A PEFT LoRA, checked and written back as intake stages it."""
    peft = train_peft(tiny_base.path, tmp_path / "peft", steps=2)
    checked = check_peft_files(read_folder(peft, 10**8), linear_shapes(str(tiny_base.path)), 256, "tiny")
    checked.save(tmp_path / "staged", tiny_base.model_id)
    return tmp_path / "staged"


def rows(answers: bool) -> list:  # type: ignore[type-arg]
    import json

    return parse_jsonl("\n".join(json.dumps(r) for r in opposite_rows(answers)).encode(), answers_optional=True)


def test_a_worker_adopts_imported_adapters_into_the_sapt_state(tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    settings = RouterSettings(mode="sapt", sapt=SAPTSettings(replay="pseudo", steps=10))
    store = SkillStore(tmp_path / "data")
    router = Router(embedder, settings, TokenPooler.from_checkpoint(tiny_base.path))
    trainer = SkillTrainer(store, router, tiny_base, sync_router=True)
    folder = staged(tiny_base, tmp_path)
    cfg = TrainConfig(max_eval_examples=12)

    first = trainer.adopt("opposites", folder, rows(answers=False), cfg, adapter_meta={"source": "upload"})
    assert first.meta["training"]["method"] == "imported" and first.meta["training"]["adapter"] == {"source": "upload"}
    assert first.meta["router"]["sapt_attention"] == {"opposites": 1.0} and "sapt_key" in first.router_tensors()
    assert first.meta["quality"]["passed"] and first.meta["eval"]["n"] == 0  # no answers: nothing to score
    assert (first.path / "adapter_config.json").read_bytes() == (folder / "adapter_config.json").read_bytes()
    want, got = load_peft_adapter(folder), first.adapter()
    assert all(torch.equal(got.modules[p].B, f.B) for p, f in want.modules.items())

    labelled = rows(answers=True)  # a barely trained block does not beat the base model on them
    with pytest.raises(QualityGateFailed):
        trainer.adopt("antonyms", folder, labelled, cfg)
    assert store.versions("antonyms") == []
    second = trainer.adopt("antonyms", folder, labelled, cfg, force=True)
    assert second.meta["quality"]["forced"] and second.meta["eval"]["n"] == 12
    assert set(second.meta["router"]["sapt_attention"]) == {"opposites", "antonyms"}
    assert len(second.probe()) == 2 and all(p["answer"] for p in second.probe() + second.replay())

    pinned = trainer.adopt("pinned", folder, [], cfg)
    assert pinned.router_tensors() == {} and pinned.meta["router"]["keys"] is False
    assert pinned.meta["quality"]["ran"] is False and pinned.probe() == [] and pinned.replay() == []
    trainer.adopt("later", folder, rows(answers=False), cfg)  # a keyless skill in the store harms no later one
    assert "pinned" not in trainer.router.skills
