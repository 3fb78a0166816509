"""`eval continual --resume`: the steps of a cut run's progress log that a resumed run keeps."""

from __future__ import annotations

import pytest

from skillpool.evaluation.baselines import logged_result, logged_training
from skillpool.evaluation.continual_resume import earlier_steps
from skillpool.trainer.config import TrainConfig


def test_resume_keeps_the_tasks_scored_whole_and_the_sides_that_finished() -> None:
    setup = {"tasks": ["a", "b", "c"], "test_limit": 2}

    def line(side: str, after: str, **rows: list[float]) -> dict:  # type: ignore[type-arg]
        return {"side": side, "after": after, "rows": rows}

    lines = [
        {"side": "run", "setup": setup},
        line("kif", "a", a=[100.0, 0.0]),
        line("forced", "a", a=[100.0, 100.0]),
        line("seq", "a", a=[0.0, 0.0]),
        line("single", "a", a=[0.0, 100.0]),
        line("kif", "b", a=[100.0, 0.0], b=[0.0, 0.0]),  # b's forced line never came: the cut fell between
        line("single", "b", b=[100.0, 100.0]),
        line("single", "c", c=[0.0, 0.0]),
        line("mtl", "c", a=[0.0, 0.0], b=[0.0, 0.0], c=[100.0, 0.0]),
    ]
    earlier = earlier_steps(lines, setup, "kif", ["a", "b", "c"], ["single", "seq", "mtl"])
    assert earlier.server == [(lines[1], lines[2])]
    assert earlier.sides == {"single": [lines[4], lines[6], lines[7]], "mtl": [lines[8]]}  # seq stopped after a
    assert earlier.lines() == [lines[i] for i in (1, 2, 4, 6, 7, 8)]
    assert logged_result("single", earlier.sides["single"], ["a", "b", "c"]) == [
        [0.0, 100.0],
        [100.0, 100.0],
        [0.0, 0.0],
    ]
    assert logged_result("mtl", earlier.sides["mtl"], ["a", "b", "c"]) == [[0.0, 0.0], [0.0, 0.0], [100.0, 0.0]]
    # a kept side's training: its lines' seconds and tokens; a line from before lines carried them is counted
    timed = [{**x, "train_s": 1.5 * i, "train_tokens": 10 * i} for i, x in enumerate(earlier.sides["single"])]
    assert logged_training(timed) == (4.5, 30, 0)
    assert logged_training([timed[0], timed[1], lines[7]]) == (1.5, 10, 1)
    # a step measured again (a resumed run that was cut too): the later line
    again = line("forced", "a", a=[0.0, 100.0])
    assert earlier_steps([*lines, again], setup, "kif", ["a", "b", "c"], []).server == [(lines[1], again)]
    with pytest.raises(SystemExit, match="the cut run had test_limit 2, this one 3"):
        earlier_steps(lines, {**setup, "test_limit": 3}, "kif", ["a", "b", "c"], [])
    with pytest.raises(SystemExit, match="does not start with its run's setup"):
        earlier_steps(lines[1:], setup, "kif", ["a", "b", "c"], [])


def test_a_log_from_before_a_config_field_existed_resumes_as_it_trained() -> None:
    now = TrainConfig(prompt_variant_copies=1).to_dict()
    older = {k: v for k, v in now.items() if k != "prompt_variant_copies"}  # recorded before the field existed
    lines = [{"side": "run", "setup": {"tasks": ["a"], "train_config": older}}]
    assert earlier_steps(lines, {"tasks": ["a"], "train_config": now}, "kif", ["a"], []).server == []
    other = TrainConfig(prompt_variant_copies=2).to_dict()
    with pytest.raises(SystemExit, match="the cut run had train_config"):
        earlier_steps(lines, {"tasks": ["a"], "train_config": other}, "kif", ["a"], [])
    assert lines[0]["setup"]["train_config"] == older  # the log's own line is read, not rewritten
