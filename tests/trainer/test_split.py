"""The held-out split: cut from the examples, or a fine-tuning job's validation file when it has one."""

from __future__ import annotations

from skillpool.trainer.config import TrainConfig
from skillpool.trainer.records import Example
from skillpool.trainer.skill_trainer import split_examples


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
