"""The held-out split: cut from the examples, or a fine-tuning job's validation file when it has one."""

from __future__ import annotations

from skillpool.trainer.config import TrainConfig
from skillpool.trainer.records import Example
from skillpool.trainer.skill_trainer import split_examples, split_imported


def rows(n: int, held_out: bool = False) -> list[Example]:
    out: list[Example] = []
    for i in range(n):
        ex: Example = {
            "messages": [{"role": "user", "content": f"q{i}"}],
            "answer": "a",
            "route_text": "q",
            "route_input": "q",
        }
        if held_out:
            ex["held_out"] = True
        out.append(ex)
    return out


def test_the_split_is_cut_from_the_examples_without_a_validation_file() -> None:
    train, held, replay, probe = split_examples(rows(40), TrainConfig(eval_fraction=0.1, probe_size=2))
    assert (len(train), len(held), len(probe)) == (36, 4, 2) and replay


def test_a_validation_file_is_the_held_out_split_and_never_trained_on() -> None:
    train, held, _, probe = split_examples(rows(40) + rows(7, held_out=True), TrainConfig(max_eval_examples=5))
    assert len(train) == 40 and not any(e.get("held_out") for e in train)
    assert len(held) == 5 and all(e.get("held_out") for e in held) and len(probe) == 5


def test_an_imports_gate_scores_every_answered_row_and_its_probe_is_held_out_of_the_keys() -> None:
    answered, bare = rows(30), rows(20)
    for e in bare:
        e["answer"] = ""
    keyed, gated, replay, probe = split_imported(answered + bare, TrainConfig(eval_fraction=0.1, max_eval_examples=25))
    assert len(probe) == 3 and all(e["answer"] for e in probe + replay) and replay
    assert len(keyed) == 47 and not any(k is p for k in keyed for p in probe)  # every row but the probe keys it
    assert len(gated) == 25 and all(e["answer"] for e in gated)  # nothing trains on them: all may be scored
    keyed, gated, replay, probe = split_imported(bare, TrainConfig())
    assert (len(keyed), gated, replay, probe) == (20, [], [], [])  # no answers: keys alone
