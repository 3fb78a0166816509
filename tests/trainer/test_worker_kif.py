"""A kif job considers the nearest earlier blocks as its start even when the new task's prompts have
another format (the usual case: the open-set and format gates would send its inputs to the base model)."""

from __future__ import annotations

from pathlib import Path

from skillpool.adapters_store.store import SkillStore
from skillpool.router import Router, RouterSettings
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.datasets import parse_jsonl
from skillpool.trainer.worker import SkillTrainer
from tests.conftest import dataset_dir


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
    assert trainer._similar_skills("sciq", [e["route_text"] for e in sciq], 3) == {"agnews": 1.0}  # the nearest
    rec = trainer.run("sciq", sciq, cfg, "kif", force=True)
    kif = rec.meta["training"]["kif"]
    assert kif["answers"] == "rouge_l" and kif["unlike_answers"] == ["agnews"]
    assert kif["init_from"] == {} and "start_candidates" not in kif  # fresh, no probe to run
    assert kif["memory_skills"] == 0 and kif["memory_examples"] == 0  # nor are agnews' rows in its memory


def test_kif_trains_the_probes_pick_beside_fresh_for_a_cycle_and_keeps_the_better(
    tiny_base, embedder, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    trainer = SkillTrainer(SkillStore(tmp_path), Router(embedder, RouterSettings()), tiny_base)
    cfg = TrainConfig(epochs=1.0, max_eval_examples=4, max_seq_len=128, kif_start_margin=0.0, kif_start_trial=1)
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
    # 36 rows at batch 8: 5 task steps and 1 outer step, after the other start's cycle (5 + 1: one partial cycle)
    assert steps == [(i, 12) for i in range(1, 13)]

    untried = trainer.run(
        "dbpedia-2", dbpedia, TrainConfig(**{**cfg.to_dict(), "kif_start_trial": 0}), "kif", force=True
    )
    assert untried.meta["training"]["kif"]["init_from"] == {"agnews": 1.0}  # 0: the probe's pick stands
    assert "start_trial" not in untried.meta["training"]["kif"]
