"""A trainer worker in sapt mode: it learns each skill into the shared SAPT state read from the store,
stores the skill's key, projector and mean attention, and (replay=pseudo) its generated pseudo inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skillpool.adapters_store.store import SkillStore
from skillpool.router import Router, RouterSettings, SAPTSettings, TokenPooler
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.datasets import parse_jsonl
from skillpool.trainer.skill_trainer import SkillTrainer
from tests.datasets import dataset_dir


def examples(task: str, n: int) -> list[dict]:  # type: ignore[type-arg]
    lines = (dataset_dir("long_sequence", task) / "train.jsonl").read_bytes().split(b"\n")[:n]
    return parse_jsonl(b"\n".join(lines))


def test_sapt_worker_learns_into_the_stored_state(tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    settings = RouterSettings(mode="sapt", sapt=SAPTSettings(replay="pseudo", steps=30))
    store = SkillStore(tmp_path)
    # a private router (as in `skillpool worker`): everything it knows comes from the store
    trainer = SkillTrainer(
        store, Router(embedder, settings, TokenPooler.from_checkpoint(tiny_base.path)), tiny_base, sync_router=True
    )
    cfg = TrainConfig(epochs=1.0, max_eval_examples=4, replay_fraction=0.05, max_seq_len=128)
    first = trainer.run("sst-2", examples("sst-2", 40), cfg, "isolated", force=True)
    second = trainer.run("agnews", examples("agnews", 40), cfg, "isolated", force=True)

    assert first.meta["router"]["mode"] == "sapt" and first.meta["router"]["sapt_attention"] == {"sst-2": 1.0}
    pseudo = first.pseudo()
    assert 1 <= len(pseudo) <= len(first.replay()) and all(isinstance(p, str) and p for p in pseudo)

    attention = second.meta["router"]["sapt_attention"]
    assert set(attention) == {"sst-2", "agnews"} and abs(sum(attention.values()) - 1) < 1e-5
    tensors = second.router_tensors()
    assert int(tensors["sapt_blocks"][0]) == 2 and tensors["sapt_key"].shape == (trainer.router.pooler.dim,)  # type: ignore[union-attr]
    # the first skill's key is frozen while the second learns
    assert torch.equal(trainer.router.sapt_state().keys[0], first.router_tensors()["sapt_key"])  # type: ignore[index]

    # a fresh server router rebuilt from the store routes with the newest projector
    serving = Router(embedder, settings, TokenPooler.from_checkpoint(tiny_base.path))
    for rec in store.list_latest():
        serving.add_skill(rec.name, rec.router_tensors(), rec.meta["router"]["sapt_attention"])
    [d] = serving.route([examples("agnews", 41)[-1]["route_text"]])
    assert d.reason in ("matched", "below_threshold") and all(s in ("sst-2", "agnews") for s, _ in d.route)
    assert serving.sapt_state().names == ["agnews", "sst-2"] or serving.sapt_state().names == ["sst-2", "agnews"]


def test_method_sapt_trains_the_block_inside_the_earlier_blocks_mix(tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    settings = RouterSettings(mode="sapt", sapt=SAPTSettings(steps=20))
    store = SkillStore(tmp_path)
    trainer = SkillTrainer(
        store, Router(embedder, settings, TokenPooler.from_checkpoint(tiny_base.path)), tiny_base, sync_router=True
    )
    cfg = TrainConfig(
        epochs=1.0, max_eval_examples=4, replay_fraction=0.05, max_seq_len=128, target_modules=["q_proj", "v_proj"]
    )
    first = trainer.run("sst-2", examples("sst-2", 24), cfg, "sapt", force=True)
    first_adapter = first.adapter()
    second = trainer.run("agnews", examples("agnews", 24), cfg, "sapt", force=True)

    assert second.meta["training"]["method"] == "sapt" and int(second.router_tensors()["sapt_blocks"][0]) == 2
    assert set(second.meta["router"]["sapt_attention"]) == {"sst-2", "agnews"}
    # the earlier block is untouched on disk, the new one is a plain PEFT LoRA on the targets that serves
    again = store.get("sst-2")
    assert again is not None and again.version == 1
    for path, f in again.adapter().modules.items():
        assert torch.equal(f.A, first_adapter.modules[path].A) and torch.equal(f.B, first_adapter.modules[path].B)
    block = second.adapter()
    assert {p.rsplit(".", 1)[1] for p in block.modules} == {"q_proj", "v_proj"}
    assert any(float(f.B.abs().sum()) > 0 for f in block.modules.values())  # it learned something
    # sapt refuses a router in another mode, before any work
    with pytest.raises(ValueError, match="--router-mode sapt"):
        SkillTrainer(store, Router(embedder), tiny_base).run("x", examples("sst-2", 24), cfg, "sapt")
