"""A kif job considers the nearest earlier blocks as its start even when the new task's prompts have
another format (the usual case: the open-set and format gates would send its inputs to the base model)."""

from __future__ import annotations

from pathlib import Path

from skillpool.adapters_store.store import SkillStore
from skillpool.router import Router, RouterSettings
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.datasets import parse_jsonl
from skillpool.trainer.methods.kif_start import similar_skills
from skillpool.trainer.skill_trainer import SkillTrainer
from tests.datasets import dataset_dir


def examples(task: str, n: int, group: str = "long_sequence") -> list[dict]:  # type: ignore[type-arg]
    lines = (dataset_dir(group, task) / "train.jsonl").read_bytes().split(b"\n")[:n]
    return parse_jsonl(b"\n".join(lines))


def test_kif_scores_the_nearest_block_that_the_gates_would_not_route_to(tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trainer = SkillTrainer(SkillStore(tmp_path), Router(embedder, RouterSettings()), tiny_base)
    cfg = TrainConfig(epochs=1.0, max_eval_examples=4, max_seq_len=128)
    first = trainer.run("agnews", examples("agnews", 40), cfg, "isolated", force=True)
    trainer.router.add_skill(first.name, first.router_tensors())  # as a server registers it
    dbpedia = examples("dbpedia", 40)  # agnews' instruction words, but other label options: another format
    gated = trainer.router.route([e["route_text"] for e in dbpedia])
    assert all(not d.route for d in gated) and {d.reason for d in gated} <= {"format_mismatch", "below_threshold"}
    ungated = trainer.router.route([e["route_text"] for e in dbpedia], open_set=False)
    assert all(d.reason == "matched" and d.route == [("agnews", 1.0)] for d in ungated)
    rec = trainer.run("dbpedia", dbpedia, cfg, "kif", force=True)
    kif = rec.meta["training"]["kif"]
    # the nearest block is a candidate start beside fresh; it wins only if it lowers dbpedia's loss by 2%
    assert [c["blocks"] for c in kif["start_candidates"]] == [{}, {"agnews": 1.0}]
    fresh, agnews = (c["loss"] for c in kif["start_candidates"])
    assert kif["init_from"] == ({"agnews": 1.0} if agnews < fresh * 0.98 else {})
    assert "start_trial" not in kif  # kif_start_trial is off by default
    assert rec.meta["training"]["kif"]["memory_skills"] == 1
    assert kif["answers"] == "exact_match" and kif["unlike_answers"] == []  # both answer from a label set


def test_kif_never_starts_a_free_text_task_from_a_label_block(tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trainer = SkillTrainer(SkillStore(tmp_path), Router(embedder, RouterSettings()), tiny_base)
    cfg = TrainConfig(epochs=1.0, max_eval_examples=4, max_seq_len=128)
    first = trainer.run("agnews", examples("agnews", 40), cfg, "isolated", force=True)
    trainer.router.add_skill(first.name, first.router_tensors())
    sciq = examples("task591_sciq_answer_generation", 40, "superni")  # free-text answers, scored by ROUGE-L
    nearest = similar_skills(trainer.router, "sciq", [e["route_text"] for e in sciq], 3)
    assert nearest == {"agnews": 1.0}
    rec = trainer.run("sciq", sciq, cfg, "kif", force=True)
    kif = rec.meta["training"]["kif"]
    assert kif["answers"] == "rouge_l" and kif["unlike_answers"] == ["agnews"]
    assert kif["init_from"] == {} and "start_candidates" not in kif  # fresh, no probe to run
    assert kif["memory_skills"] == 0 and kif["memory_examples"] == 0  # nor are agnews' rows in its memory


def test_kif_trains_the_probes_pick_beside_fresh_for_a_cycle_and_keeps_the_better(
    tiny_base, embedder, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    trainer = SkillTrainer(SkillStore(tmp_path), Router(embedder, RouterSettings()), tiny_base)
    cfg = TrainConfig(
        epochs=1.0,
        max_eval_examples=4,
        max_seq_len=128,
        kif_start_margin=0.0,
        kif_start_trial=1,
        prompt_variant_copies=1,
    )
    first = trainer.run("agnews", examples("agnews", 40), cfg, "isolated", force=True)
    trainer.router.add_skill(first.name, first.router_tensors())
    dbpedia = examples("dbpedia", 40)
    steps: list[tuple[int, int]] = []
    rec = trainer.run("dbpedia", dbpedia, cfg, "kif", on_progress=lambda p: steps.append((p.step, p.total)), force=True)
    kif = rec.meta["training"]["kif"]
    fresh, agnews = (c["loss"] for c in kif["start_candidates"])
    assert agnews < fresh  # the probe picks agnews' block ...
    finalists = kif["start_trial"]  # ... which then trains a cycle beside fresh, judged on the 4 held-out rows
    assert [f["blocks"] for f in finalists] == [{}, {"agnews": 1.0}]
    best = min(finalists, key=lambda f: f["held_out_loss"])
    assert [f.get("kept", False) for f in finalists] == [f is best for f in finalists]
    assert kif["init_from"] == best["blocks"]
    # 36 rows and their 36 variants (one copy) at batch 8: 9 task steps and 1 outer step, after the other
    # start's cycle (9 + 1: one partial cycle)
    assert steps == [(i, 20) for i in range(1, 21)]

    untried = trainer.run(
        "dbpedia-2", dbpedia, TrainConfig(**{**cfg.to_dict(), "kif_start_trial": 0}), "kif", force=True
    )
    assert untried.meta["training"]["kif"]["init_from"] == {"agnews": 1.0}  # 0: the probe's pick stands
    assert "start_trial" not in untried.meta["training"]["kif"]


def test_kif_start_latest_continues_the_newest_block_of_its_answer_kind(tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trainer = SkillTrainer(SkillStore(tmp_path), Router(embedder, RouterSettings()), tiny_base)
    cfg = TrainConfig(epochs=1.0, max_eval_examples=4, max_seq_len=128)
    earlier = [
        ("agnews", examples("agnews", 40)),
        ("sciq", examples("task591_sciq_answer_generation", 40, "superni")),  # free text
        ("dbpedia", examples("dbpedia", 40)),
    ]
    for name, rows in earlier:
        rec = trainer.run(name, rows, cfg, "isolated", force=True)
        trainer.router.add_skill(rec.name, rec.router_tensors())
    # a learning rate this small leaves the block where it started, so the stored block shows the start
    latest = TrainConfig(**{**cfg.to_dict(), "kif_start": "latest", "learning_rate": 1e-9})
    sst2 = trainer.run("sst-2", examples("sst-2", 40), latest, "kif", force=True)
    kif = sst2.meta["training"]["kif"]
    assert kif["start"] == "latest" and kif["init_from"] == {"dbpedia": 1.0}  # the newest label block, not agnews
    assert "start_candidates" not in kif  # taken whole: no probe
    start, got = trainer.store.get("dbpedia").adapter().modules, sst2.adapter().modules  # type: ignore[union-attr]
    assert got.keys() == start.keys()
    for path, block in start.items():
        want = block.delta()
        assert (got[path].delta() - want).norm() <= 1e-3 * want.norm(), path
    # a free-text task continues sciq's block, the newest of its kind, though two label blocks are newer
    quoref = trainer.run(
        "quoref", examples("task002_quoref_answer_generation", 40, "superni"), latest, "kif", force=True
    )
    assert quoref.meta["training"]["kif"]["init_from"] == {"sciq": 1.0}
    assert quoref.meta["training"]["kif"]["unlike_answers"] == ["agnews", "dbpedia", "sst-2"]
    fresh = trainer.run(
        "agnews-2", examples("agnews", 40), TrainConfig(**{**latest.to_dict(), "kif_init_blocks": 0}), "kif", force=True
    )
    assert fresh.meta["training"]["kif"]["init_from"] == {}  # kif_init_blocks 0: fresh, as for "similar"
